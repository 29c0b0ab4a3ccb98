"""Per-device layer forms (`aserve/model/layers/custom_op.py`): dispatch, and every CPU form against
its native form (exact in fp32, within bf16 rounding in bf16)."""

from __future__ import annotations

import pytest
import torch

from aserve.model.layers.activation import SiluAndMul
from aserve.model.layers.custom_op import FORCE_NATIVE_ENV, CustomOp
from aserve.model.layers.norm import RMSNorm
from aserve.model.layers.rotary import RotaryEmbedding


class _OnlyNative(CustomOp):
    def forward_native(self, x):
        return x + 1


def test_form_follows_the_build_device_and_the_force_native_switch(monkeypatch):
    assert RMSNorm(8).form == "cpu"
    assert _OnlyNative().form == "native"
    assert RMSNorm.choose_form("cuda") == "cuda"  # the Triton kernel (tests/model/layers/test_cuda_forms.py)
    assert _OnlyNative()(torch.zeros(2)).tolist() == [1.0, 1.0]
    monkeypatch.setenv(FORCE_NATIVE_ENV, "1")
    assert RMSNorm(8).form == "native"


def _tolerance(dtype: torch.dtype) -> dict:
    return {"atol": 0, "rtol": 0} if dtype == torch.float32 else {"atol": 2e-2, "rtol": 1.6e-2}  # bf16 eps


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rms_norm_cpu_form_matches_native(dtype):
    gen = torch.Generator().manual_seed(0)
    norm = RMSNorm(64, 1e-5, dtype=dtype)
    norm.weight.data = (1 + 0.3 * torch.randn(64, generator=gen)).to(dtype)
    x, residual = (torch.randn(5, 64, generator=gen).to(dtype) for _ in range(2))
    torch.testing.assert_close(norm.forward_cpu(x), norm.forward_native(x), **_tolerance(dtype))
    got, got_sum = norm.forward_cpu(x, residual)
    want, want_sum = norm.forward_native(x, residual)
    torch.testing.assert_close(got, want, **_tolerance(dtype))
    assert torch.equal(got_sum.to(dtype), want_sum)  # bf16 with the C kernel: the unrounded fp32 sum


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("rotary_dim", [32, 16])  # 16 of 32: partial rotary passes the rest through
def test_rotary_cpu_form_matches_native(dtype, rotary_dim):
    gen = torch.Generator().manual_seed(1)
    rope = RotaryEmbedding(32, rotary_dim, 128, 10000.0, dtype=dtype)
    qkv = torch.randn(7, (4 + 2 * 2) * 32, generator=gen).to(dtype)
    q, k, _ = qkv.split([4 * 32, 2 * 32, 2 * 32], dim=-1)  # strided views, as the model passes them
    q, k = q.view(7, 4, 32), k.view(7, 2, 32)
    cos_sin = rope.cos_sin(torch.tensor([0, 1, 5, 17, 63, 64, 127]))
    for got, want in zip(rope.forward_cpu(cos_sin, q, k), rope.forward_native(cos_sin, q, k), strict=True):
        assert got.is_contiguous()
        torch.testing.assert_close(got, want, **_tolerance(dtype))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_silu_and_mul_cpu_form_matches_native(dtype):
    x = torch.randn(3, 2 * 48, generator=torch.Generator().manual_seed(2)).to(dtype)
    act = SiluAndMul(dtype)
    torch.testing.assert_close(act.forward_cpu(x), act.forward_native(x), **_tolerance(dtype))


def test_bf16_cpu_forms_round_once_with_the_c_kernels():
    """With the C kernels, bf16 CPU forms compute in fp32 and round once: closer to an fp32 model than
    the native forms, which round after every op like Hugging Face's bf16 modules."""
    act = SiluAndMul(torch.bfloat16)
    if act.cpu_kernels is None:
        pytest.skip("the C kernels cannot be built here")
    x = (torch.randn(64, 2 * 256, generator=torch.Generator().manual_seed(3)) * 3).to(torch.bfloat16)
    exact = torch.nn.functional.silu(x[:, :256].float()) * x[:, 256:].float()
    def error(y):
        return (y.float() - exact).abs().mean().item()
    assert error(act.forward_cpu(x)) < error(act.forward_native(x))
