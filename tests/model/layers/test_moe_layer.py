"""The MoE layer: routing as transformers' routers do it, and the grouped CPU forms (float weights,
aserve's bf16 C kernels and oneDNN-packed weights per expert) against the torch reference with uneven
expert loads (idle experts, one expert taking every token)."""

from __future__ import annotations

import pytest
import torch
import transformers
from transformers.models.mixtral.modeling_mixtral import MixtralTopKRouter
from transformers.models.qwen2_moe.modeling_qwen2_moe import Qwen2MoeTopKRouter

from aserve.kernels import cpu_ops, reference
from aserve.model.layers.moe import FusedMoE, select_experts
from aserve.model.quantization.cpu_kernel import CpuKernelLinearMethod
from aserve.model.quantization.cpu_packed import CpuPackedLinearMethod, cpu_packing_supported
from tests.support.triton_interpreter import requires_interpreter

E, H, I = 8, 64, 48


@pytest.mark.parametrize(("router_cls", "config"), [
    (MixtralTopKRouter, transformers.MixtralConfig(hidden_size=H, num_local_experts=E, num_experts_per_tok=2)),
    (Qwen2MoeTopKRouter, transformers.Qwen2MoeConfig(hidden_size=H, num_experts=E, num_experts_per_tok=3,
                                                     norm_topk_prob=False)),
    (Qwen2MoeTopKRouter, transformers.Qwen2MoeConfig(hidden_size=H, num_experts=E, num_experts_per_tok=2,
                                                     norm_topk_prob=True)),
])
def test_select_experts_matches_transformers_routers(router_cls, config):
    gen = torch.Generator().manual_seed(0)
    router = router_cls(config)
    router.weight.data = torch.randn(E, H, generator=gen)
    x = torch.randn(13, H, generator=gen)
    _, want_weights, want_ids = router(x)
    renormalize = getattr(config, "norm_topk_prob", True)
    weights, ids = select_experts(torch.nn.functional.linear(x, router.weight), config.num_experts_per_tok,
                                  renormalize)
    assert torch.equal(ids, want_ids)
    torch.testing.assert_close(weights, want_weights)


def _layer(dtype: torch.dtype, gen: torch.Generator) -> FusedMoE:
    layer = FusedMoE(E, H, I, dtype)
    layer.gate_up_proj.data = (torch.randn(E, 2 * I, H, generator=gen) * H**-0.5).to(dtype)
    layer.down_proj.data = (torch.randn(E, H, I, generator=gen) * I**-0.5).to(dtype)
    return layer


def _uneven_routing(num_tokens: int, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """Expert 6 takes every token; the second expert is one of 0..2; experts 3, 4, 5, 7 stay idle."""
    ids = torch.stack([torch.full((num_tokens,), 6), torch.randint(0, 3, (num_tokens,), generator=gen)], dim=1)
    return torch.rand(num_tokens, 2, generator=gen).softmax(-1), ids


@pytest.mark.parametrize("num_tokens", [1, 7, 40])
def test_fp32_grouped_forms_match_reference(num_tokens):
    gen = torch.Generator().manual_seed(num_tokens)
    layer = _layer(torch.float32, gen)
    x = torch.randn(num_tokens, H, generator=gen)
    weights, ids = _uneven_routing(num_tokens, gen)
    want = reference.fused_moe(x, layer.gate_up_proj, layer.down_proj, weights, ids)
    assert layer.form == "cpu"
    torch.testing.assert_close(layer(x, weights, ids), want, atol=0, rtol=0)
    torch.testing.assert_close(layer.forward_native(x, weights, ids), want, atol=0, rtol=0)


def _bf16_methods():
    methods = []
    kernels = cpu_ops.load()
    if kernels is not None and kernels.packed_matmuls:
        methods.append(pytest.param(lambda: CpuKernelLinearMethod(kernels), True, id="c-kernel-vnni"))
    if cpu_packing_supported(torch.bfloat16, "cpu"):
        methods.append(pytest.param(CpuPackedLinearMethod, False, id="onednn-packed"))
    return methods or [pytest.param(None, False, marks=pytest.mark.skip(reason="no bf16 CPU matmul form here"))]


@pytest.mark.parametrize(("make_method", "float_output"), _bf16_methods())
@pytest.mark.parametrize("num_tokens", [1, 16, 40])
def test_bf16_expert_methods_within_bf16_rounding(make_method, float_output, num_tokens):
    gen = torch.Generator().manual_seed(100 + num_tokens)
    layer = _layer(torch.bfloat16, gen)
    w13, w2 = layer.gate_up_proj.float().clone(), layer.down_proj.float().clone()
    layer.quant_method, layer.float_output = make_method(), float_output
    layer.process_weights_after_loading()
    assert layer.gate_up_experts is not None and not hasattr(layer, "gate_up_proj")  # stacked copies dropped
    x = torch.randn(num_tokens, H, generator=gen).to(torch.bfloat16)
    weights, ids = _uneven_routing(num_tokens, gen)
    got = layer(x, weights, ids)
    assert got.dtype == (torch.float32 if float_output else torch.bfloat16)
    want = reference.fused_moe(x.float(), w13, w2, weights, ids)
    torch.testing.assert_close(got.float(), want, atol=2e-2, rtol=1.6e-2)


def test_cuda_form_is_the_triton_kernel():
    """On CUDA the layer calls `fused_experts` on its stacked weights (run here through the interpreter)."""
    requires_interpreter()
    from aserve.kernels.fused_moe import fused_experts

    assert FusedMoE.choose_form("cuda") == "cuda"
    gen = torch.Generator().manual_seed(3)
    layer = _layer(torch.float32, gen)
    layer._fused_experts = fused_experts  # what a layer built on a CUDA device holds
    x = torch.randn(9, H, generator=gen)
    weights, ids = _uneven_routing(9, gen)
    torch.testing.assert_close(layer.forward_cuda(x, weights, ids), layer.forward_native(x, weights, ids),
                               atol=1e-5, rtol=1e-5)
