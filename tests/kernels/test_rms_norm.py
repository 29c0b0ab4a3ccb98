"""rms_norm (plain and fused residual add) against the torch reference."""

from __future__ import annotations

import pytest
import torch
from aserve.kernels import reference
from aserve.kernels.rms_norm import rms_norm

TOL = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 2e-2}


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("shape", [(5, 64), (3, 96), (2, 2, 200)], ids=str)
def test_matches_reference(device, gen, dtype, shape):
    x = (torch.randn(shape, generator=gen) * 3).to(dtype).to(device)
    weight = torch.randn(shape[-1], generator=gen).to(dtype).to(device)
    got = rms_norm(x, weight, 1e-6)
    want = reference.rms_norm(x, weight, 1e-6)
    assert got.shape == x.shape and got.dtype == dtype
    torch.testing.assert_close(got.float(), want.float(), atol=TOL[dtype], rtol=TOL[dtype])


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=str)
def test_fused_residual_add(device, gen, dtype):
    x = torch.randn(4, 96, generator=gen).to(dtype).to(device)
    residual = torch.randn(4, 96, generator=gen).to(dtype).to(device)
    weight = torch.randn(96, generator=gen).to(dtype).to(device)
    out, summed = rms_norm(x, weight, 1e-5, residual)
    want_out, want_sum = reference.rms_norm(x, weight, 1e-5, residual)
    assert torch.equal(summed, want_sum)  # one rounding of the same fp32 sum
    torch.testing.assert_close(out.float(), want_out.float(), atol=TOL[dtype], rtol=TOL[dtype])


def test_inputs_unchanged_and_strided_rows(device, gen):
    base = torch.randn(3, 128, generator=gen).to(device)
    x = base[:, :64]  # rows with a stride of 128
    before = base.clone()
    weight = torch.ones(64, device=device)
    got = rms_norm(x, weight, 1e-6)
    assert torch.equal(base, before)
    torch.testing.assert_close(got, reference.rms_norm(x, weight, 1e-6), atol=1e-5, rtol=1e-5)


def test_bad_input_names_the_argument():
    with pytest.raises(ValueError, match="weight"):
        rms_norm(torch.zeros(2, 8), torch.ones(7), 1e-6)
    with pytest.raises(ValueError, match="residual"):
        rms_norm(torch.zeros(2, 8), torch.ones(8), 1e-6, torch.zeros(2, 7))
    with pytest.raises(ValueError, match="x: dtype"):
        rms_norm(torch.zeros(2, 8, dtype=torch.int64), torch.ones(8), 1e-6)
