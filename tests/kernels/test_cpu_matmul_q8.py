"""`linear_q8` (aserve/kernels/cpu_matmul_q8.c): 8-bit codes with a scale per 32 (GGUF's Q8_0) against
an exact emulation of its arithmetic and against the float product, on this CPU's build and the portable
ones (x86-64-v2 has no AVX2: the kernel is absent there and says so)."""

from __future__ import annotations

import shutil

import pytest
import torch

from aserve.kernels import cpu_ops
from tests.support.cpu_marches import MARCHES, build_cpu_kernels

pytestmark = pytest.mark.skipif(shutil.which("cc") is None, reason="no C compiler")


@pytest.fixture(scope="module", params=MARCHES)
def kernels(request) -> cpu_ops.CpuKernels:
    return build_cpu_kernels(request.param)


def _weight(n: int, k: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    codes = torch.randint(-128, 128, (n, k), generator=gen, dtype=torch.int8)
    return codes, torch.rand(n, k // 32, generator=gen) * 0.02 + 0.001


def emulated(x: torch.Tensor, codes: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """The kernel's arithmetic: x rounded to int16 per group of 32 (scale max|x| / 32767, nearest even), exact
    integer dot products per group, then sum_g float(dot) * (scale_w * scale_x) in fp32 (fp64 here: the
    kernel's fused multiply-adds round less than separate fp32 steps would)."""
    m, k = x.shape
    groups = x.float().reshape(m, k // 32, 32)
    sx = groups.abs().amax(dim=2) / 32767.0
    safe = torch.where(sx > 0, sx, torch.ones_like(sx))
    xq = torch.where(sx[..., None] > 0, (groups / safe[..., None]).clamp(-32767, 32767).round(), 0.0)
    dots = torch.einsum("mgj,ngj->mng", xq.double(), codes.double().reshape(-1, k // 32, 32))
    return (dots * (scales.double()[None] * sx.double()[:, None, :])).sum(dim=2)


@pytest.mark.parametrize("rows", [1, 3, 17])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_linear_q8_is_its_emulation_and_close_to_the_float_product(kernels, rows, dtype):
    codes, scales = _weight(96, 160, seed=rows)
    packed = kernels.pack_q8(codes, scales)
    assert packed[0].shape == (3, 80, 32, 2) and packed[1].shape == (3, 5, 32)
    x = (torch.randn(rows, 320, generator=torch.Generator().manual_seed(7)) * 3).to(dtype)[:, :160]  # strided rows
    if not kernels.q8_products:
        with pytest.raises(RuntimeError, match="no AVX2"):
            kernels.linear_q8(x, packed)
        return
    got = kernels.linear_q8(x, packed)
    assert got.dtype == torch.float32 and got.shape == (rows, 96)
    want = emulated(x, codes, scales)
    torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-5)
    weight = codes.float() * scales.repeat_interleave(32, dim=1)
    exact = x.double() @ weight.double().T  # int16 rounding of x: ~1e-5 of each group's largest |x|
    torch.testing.assert_close(got.double(), exact, rtol=1e-3, atol=2e-3)


def test_linear_q8_columns_land_in_order_whatever_the_pattern(kernels):
    """A weight whose column c holds the value c (one group) makes any column misplaced by the packing visible."""
    if not kernels.q8_products:
        pytest.skip("no AVX2 in this build")
    n, k = 64, 32
    codes = (torch.arange(n) - 32).to(torch.int8)[:, None].expand(n, k).contiguous()
    x = torch.ones(1, k)
    got = kernels.linear_q8(x, kernels.pack_q8(codes, torch.ones(n, 1)))
    torch.testing.assert_close(got[0], (torch.arange(n) - 32).float() * k)


def test_zero_rows_and_groups(kernels):
    if not kernels.q8_products:
        pytest.skip("no AVX2 in this build")
    codes, scales = _weight(32, 64, seed=3)
    x = torch.zeros(2, 64)
    x[1, 32:] = torch.linspace(-1, 1, 32)  # first group all zeros (scale 0), second not
    got = kernels.linear_q8(x, kernels.pack_q8(codes, scales))
    assert torch.equal(got[0], torch.zeros(32))
    torch.testing.assert_close(got.double(), emulated(x, codes, scales), rtol=1e-5, atol=1e-6)


def test_pack_q8_refuses_shapes_it_cannot_take(kernels):
    codes, scales = _weight(48, 64, seed=4)
    assert kernels.pack_q8(codes, scales) is None  # 48 columns: not a multiple of 32
    assert kernels.pack_q8(codes[:32, :48], scales[:32, :1]) is None  # K not a multiple of 32
    packed = kernels.pack_q8(codes[:32], scales[:32])
    with pytest.raises(ValueError, match="linear_q8"):
        kernels.linear_q8(torch.zeros(1, 32), packed)
