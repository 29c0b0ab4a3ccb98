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


def _near_ties(n: int, k: int, seed: int) -> torch.Tensor:
    """bf16 rows that differ from one base row by a few of the 8-bit copy's steps, so the 8-bit products often
    rank them differently from the exact ones (what the screen's bound must cover)."""
    gen = torch.Generator().manual_seed(seed)
    base = torch.randn(1, k, generator=gen) * 0.05
    step = base.reshape(1, k // 32, 32).abs().amax(dim=2).repeat_interleave(32, dim=1) / 127
    return (base + (torch.rand(n, k, generator=gen) - 0.5) * step * 16).bfloat16()


@pytest.mark.parametrize("rows", [1, 5])
def test_screen_q8_keeps_every_rows_exact_argmax(kernels, rows):
    """Near-tied columns: the exact argmax (fp64 of the bf16 products) is always a candidate, while the 8-bit
    products alone often pick another column; candidates come in column order, fewer than all."""
    n, k = 256, 160
    weight = _near_ties(n, k, seed=rows)
    packed = kernels.pack_q8(*kernels.quantize_q8(weight))
    wrong_alone, narrowed = 0, 0
    for trial in range(20):
        x = (torch.randn(rows, 2 * k, generator=torch.Generator().manual_seed(trial)) * 2).bfloat16()[:, :k]
        if not kernels.q8_products:
            with pytest.raises(RuntimeError, match="no AVX2"):
                kernels.screen_q8(x, packed, 64)
            return
        cand, counts = kernels.screen_q8(x, packed, n)
        exact = x.double() @ weight.double().T
        approx = kernels.linear_q8(x, packed)
        for m in range(rows):
            found = cand[m, :counts[m]].tolist()
            assert 0 < counts[m] <= n and found == sorted(set(found))
            assert int(exact[m].argmax()) in found
            wrong_alone += int(approx[m].argmax()) != int(exact[m].argmax())
            narrowed += int(counts[m]) < n // 2
    assert wrong_alone > 0 and narrowed > 10 * rows  # (the case needs the bound, and the bound narrows)


def test_screen_q8_gives_up_on_rows_it_cannot_narrow(kernels):
    """Every column tied (more candidates than asked for) and a NaN row: count -1, the other row still screened."""
    if not kernels.q8_products:
        pytest.skip("no AVX2 in this build")
    weight = (torch.randn(1, 64) * 0.1).expand(96, 64).contiguous().bfloat16()
    packed = kernels.pack_q8(*kernels.quantize_q8(weight))
    x = torch.randn(2, 64).bfloat16()
    assert kernels.screen_q8(x, packed, 16)[1].tolist() == [-1, -1]
    weight[40] += 0.5  # one column now wins by far
    packed = kernels.pack_q8(*kernels.quantize_q8(weight))
    x = torch.ones(2, 64).bfloat16()
    x[1, 3] = float("nan")
    cand, counts = kernels.screen_q8(x, packed, 16)
    assert counts.tolist() == [1, -1] and cand[0, 0] == 40


def test_quantize_q8_rounds_within_half_a_step(kernels):
    weight = torch.randn(64, 96) * torch.linspace(0.01, 3, 96)
    weight[5, :32] = 0  # an all-zero group: scale 0, codes 0
    codes, scales = kernels.quantize_q8(weight)
    assert codes.dtype == torch.int8 and scales.shape == (64, 3) and scales[5, 0] == 0
    error = (weight - codes.float() * scales.repeat_interleave(32, dim=1)).abs()
    assert bool((error <= scales.repeat_interleave(32, dim=1) / 2 * (1 + 1e-6)).all())
    assert int(codes.abs().max()) == 127


def test_screen_q8_bound_covers_the_worst_rounding(kernels):
    """Adversarial rows: A's weights sit 0.45 of a step above codes of 0 in the direction of x's signs (its 8-bit
    product underestimates it by ~0.45 step * sum |x|), B's 0.45 below, but one code of B rounds up to 1 where x is
    large. B's 8-bit product is the larger, A's exact logit is; a bound of half the weight rounding term loses A."""
    if not kernels.q8_products:
        pytest.skip("no AVX2 in this build")
    step = 2.0**-7
    x = torch.tensor([(-1.0) ** i * (1 + (i % 5)) for i in range(32)])
    x[31] = 0.0  # where both rows hold 127 steps (so the scale is exactly `step`)
    x[0] = 0.85 * (x.abs().sum() - x[0].abs()) / 0.15  # x[0] is then 0.85 of sum |x|: A still wins by 0.05
    x = x.bfloat16()
    signs = x.float().sign()
    weight = torch.zeros(32, 32)
    weight[7] = 0.45 * step * signs  # A
    weight[3] = -0.45 * step * signs  # B ...
    weight[3, 0] = 0.55 * step  # ... whose code at x[0] (> 0) rounds up to 1
    weight[[3, 7], 31] = 127 * step
    weight = weight.bfloat16()
    codes, scales = kernels.quantize_q8(weight)
    assert codes[7, :31].abs().sum() == 0 and codes[3, 0] == 1 and scales[7, 0] == step
    packed = kernels.pack_q8(codes, scales)
    exact = x.double() @ weight.double().T
    approx = kernels.linear_q8(x[None], packed)[0]
    assert int(exact.argmax()) == 7 and int(approx.argmax()) == 3
    cand, counts = kernels.screen_q8(x[None], packed, 32)
    assert 7 in cand[0, :counts[0]].tolist()
