"""silu_and_mul against the torch reference."""

from __future__ import annotations

import pytest
import torch
from aserve.kernels import reference
from aserve.kernels.activation import silu_and_mul

TOL = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 2e-2}


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("shape", [(4, 128), (3, 200), (2, 3000), (2, 2, 96)], ids=str)
def test_matches_reference(device, gen, dtype, shape):
    x = (torch.randn(shape, generator=gen) * 4).to(dtype).to(device)
    got = silu_and_mul(x)
    want = reference.silu_and_mul(x)
    assert got.shape == (*shape[:-1], shape[-1] // 2) and got.dtype == dtype
    torch.testing.assert_close(got.float(), want.float(), atol=TOL[dtype], rtol=TOL[dtype])


def test_extreme_gates_stay_finite(device):
    x = torch.tensor([[-200.0, 0.0, 200.0, 1.0, 1.0, 1.0]], device=device)
    got = silu_and_mul(x)
    torch.testing.assert_close(got, torch.tensor([[0.0, 0.0, 200.0]], device=device))


def test_odd_last_dim_is_rejected():
    with pytest.raises(ValueError, match="x: last dim must be even"):
        silu_and_mul(torch.zeros(2, 7))
