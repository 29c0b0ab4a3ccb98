"""bf16 Linear layers and the LM head through aserve's C kernel (`aserve/model/quantization/cpu_kernel.py`):
decode-sized batches in the kernel (within one bf16 rounding of fp32), larger ones in `F.linear`."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from aserve.kernels import cpu_ops
from aserve.model.layers.embedding import LMHead
from aserve.model.layers.linear import MergedLinear
from aserve.model.quantization.cpu_kernel import KERNEL_MAX_ROWS, CpuKernelLinearMethod

KERNELS = cpu_ops.load()
pytestmark = pytest.mark.skipif(KERNELS is None, reason="the C kernels cannot be built here")


def _layer() -> MergedLinear:
    gen = torch.Generator().manual_seed(0)
    layer = MergedLinear(64, [64, 32, 32], bias=True, dtype=torch.bfloat16)
    for p in layer.parameters():
        p.data = (torch.randn(p.shape, generator=gen) * 0.2).to(torch.bfloat16)
    layer.quant_method = CpuKernelLinearMethod(KERNELS)
    layer.process_weights_after_loading()
    return layer


@pytest.mark.parametrize("rows", [1, 7, KERNEL_MAX_ROWS])
def test_decode_sized_batches_round_the_fp32_product_once(rows):
    layer = _layer()
    x = torch.randn(rows, 64, generator=torch.Generator().manual_seed(rows)).to(torch.bfloat16)
    want = F.linear(x.float(), layer.weight.float(), layer.bias.float())
    got = layer(x)
    assert got.dtype == torch.bfloat16
    torch.testing.assert_close(got.float(), want, atol=0, rtol=2**-8)  # one bf16 rounding


def test_prefill_sized_batches_use_f_linear_exactly():
    layer = _layer()
    x = torch.randn(KERNEL_MAX_ROWS + 1, 64, generator=torch.Generator().manual_seed(1)).to(torch.bfloat16)
    assert torch.equal(layer(x), F.linear(x, layer.weight, layer.bias))
    rows_3d = x[:6].view(2, 3, 64)  # not 2-D rows: F.linear too
    assert torch.equal(layer(rows_3d), F.linear(rows_3d, layer.weight, layer.bias))


def test_lm_head_gives_unrounded_float_logits():
    head = LMHead(96, 64, dtype=torch.bfloat16)
    head.weight.data = torch.randn(96, 64, generator=torch.Generator().manual_seed(2)).to(torch.bfloat16)
    head.use_cpu_kernel(KERNELS)
    hidden = torch.randn(3, 64, generator=torch.Generator().manual_seed(3)).to(torch.bfloat16)
    logits = head(hidden)
    assert logits.dtype == torch.float32
    torch.testing.assert_close(logits, hidden.float() @ head.weight.float().T, rtol=1e-5, atol=1e-5)


def test_float_output_layers_return_unrounded_float32_for_decode_sized_batches():
    layer = _layer()
    layer.quant_method = CpuKernelLinearMethod(KERNELS, float_output=True)
    x = torch.randn(3, 64, generator=torch.Generator().manual_seed(4)).to(torch.bfloat16)
    got = layer(x)
    assert got.dtype == torch.float32
    torch.testing.assert_close(got, F.linear(x.float(), layer.weight.float(), layer.bias.float()), rtol=1e-5, atol=1e-5)
    big = torch.randn(KERNEL_MAX_ROWS + 1, 64, generator=torch.Generator().manual_seed(5)).to(torch.bfloat16)
    assert layer(big).dtype == torch.bfloat16  # prefill-sized: F.linear, as every other layer


def test_the_loader_gives_float_outputs_to_the_models_residual_and_gate_projections():
    from aserve.config.hf_config import ArchConfig
    from aserve.model.attention.torch_backend import TorchAttentionBackend
    from aserve.model.models.llama import LlamaForCausalLM
    from aserve.model.quantization.assign import linear_layers, use_cpu_linear_forms

    arch = ArchConfig.from_hf_dict({"architectures": ["LlamaForCausalLM"], "hidden_size": 64, "intermediate_size": 96,
                                    "num_attention_heads": 4, "num_key_value_heads": 2, "num_hidden_layers": 2,
                                    "vocab_size": 100, "max_position_embeddings": 128})
    model = LlamaForCausalLM(arch, TorchAttentionBackend(), torch.bfloat16)
    assert use_cpu_linear_forms(model) == 4 * arch.num_hidden_layers
    floats = {name.rsplit(".", 1)[-1] for name, layer in linear_layers(model)
              if layer.quant_method.out_dtype == torch.float32}
    assert floats == {"o_proj", "down_proj", "gate_up_proj"}
