"""bf16 Linear layers and the LM head through aserve's C kernels (`aserve/model/quantization/cpu_kernel.py`):
packed weights for any batch (within one bf16 rounding of fp32), shapes that do not pack through the
unpacked kernel for decode-sized batches and `F.linear` beyond, float32 outputs where the model allows."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from aserve.kernels import cpu_ops
from aserve.model.layers.embedding import LMHead
from aserve.model.layers.linear import MergedLinear
from aserve.model.quantization.cpu_kernel import KERNEL_MAX_ROWS, CpuKernelLinearMethod

KERNELS = cpu_ops.load()
pytestmark = pytest.mark.skipif(KERNELS is None or not KERNELS.packed_matmuls,
                                reason="the C kernels cannot be built here or have no packed products (AVX512-BF16 or AVX2)")


def _layer(output_sizes=(64, 32, 32), float_output=False) -> tuple[MergedLinear, torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    layer = MergedLinear(64, list(output_sizes), bias=True, dtype=torch.bfloat16)
    for p in layer.parameters():
        p.data = (torch.randn(p.shape, generator=gen) * 0.2).to(torch.bfloat16)
    weight = layer.weight.detach().clone()
    layer.quant_method = CpuKernelLinearMethod(KERNELS)
    layer.float_output = float_output
    layer.process_weights_after_loading()
    return layer, weight, layer.bias


def _rows(n: int, seed: int) -> torch.Tensor:
    return torch.randn(n, 64, generator=torch.Generator().manual_seed(seed)).to(torch.bfloat16)


@pytest.mark.parametrize("rows", [1, 7, KERNEL_MAX_ROWS, 200])
def test_packed_layers_round_the_fp32_product_once_for_any_batch(rows):
    layer, weight, bias = _layer()
    assert layer.vnni_weight is not None and getattr(layer, "weight", None) is None  # one copy: the packed one
    x = _rows(rows, rows)
    got = layer(x)
    assert got.dtype == torch.bfloat16
    torch.testing.assert_close(got.float(), F.linear(x.float(), weight.float(), bias.float()), atol=0, rtol=2**-8)
    if rows >= 6:
        batched = layer(x[:6].view(2, 3, 64))  # 3-D input: same rows
        assert torch.equal(batched.view(6, -1), layer(x[:6]))


def test_unpackable_shapes_use_the_unpacked_kernel_then_f_linear():
    layer, weight, bias = _layer((24, 16))  # N = 40: not a multiple of 16
    assert getattr(layer, "vnni_weight", None) is None
    small = _rows(5, 1)
    torch.testing.assert_close(layer(small).float(), F.linear(small.float(), weight.float(), bias.float()),
                               atol=0, rtol=2**-8)
    big = _rows(KERNEL_MAX_ROWS + 1, 2)
    assert torch.equal(layer(big), F.linear(big, weight, bias))


def test_float_output_layers_return_the_unrounded_float32_product():
    layer, weight, bias = _layer(float_output=True)
    for rows in (3, 100):
        x = _rows(rows, 4)
        got = layer(x)
        assert got.dtype == torch.float32
        torch.testing.assert_close(got, F.linear(x.float(), weight.float(), bias.float()), rtol=1e-5, atol=1e-5)
    assert layer(x[:6].view(2, 3, 64)).dtype == torch.bfloat16  # not 2-D rows: bf16, as the layer's dtype


def test_lm_head_gives_unrounded_float_logits():
    head = LMHead(96, 64, dtype=torch.bfloat16)
    head.weight.data = torch.randn(96, 64, generator=torch.Generator().manual_seed(2)).to(torch.bfloat16)
    head.use_cpu_kernel(KERNELS)
    assert head.vnni_weight is not None
    hidden = _rows(3, 3)
    logits = head(hidden)
    assert logits.dtype == torch.float32
    torch.testing.assert_close(logits, hidden.float() @ head.weight.float().T, rtol=1e-5, atol=1e-5)


def test_packed_layers_compile_as_one_op():
    layer, weight, bias = _layer()
    x = _rows(4, 5)
    compiled = torch.compile(layer, backend="eager", fullgraph=True)
    torch.testing.assert_close(compiled(x).float(), F.linear(x.float(), weight.float(), bias.float()),
                               atol=0, rtol=2**-8)


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
    layers = linear_layers(model)
    assert all(isinstance(layer.quant_method, CpuKernelLinearMethod) for _, layer in layers)
    floats = {name.rsplit(".", 1)[-1] for name, layer in layers if layer.float_output}
    assert floats == {"o_proj", "down_proj", "gate_up_proj"}
