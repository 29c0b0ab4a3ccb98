"""The float32-GEMM form of the packed products (`aserve/kernels/cpu_float_gemm.py`): from FLOAT_GEMM_MIN_ROWS rows
the AVX2 form turns the packed weight into its float32 transpose a slab of columns at a time (bf16 widened exactly,
4-bit codes dequantized) and calls torch's GEMM; other builds, and fewer rows, keep the kernels. Checked on this
CPU's build and the portable x86-64-v3 (AVX2) and x86-64-v2 builds, as test_cpu_ops.py does."""

from __future__ import annotations

import shutil

import pytest
import torch

from aserve.kernels import cpu_float_gemm
from aserve.kernels.cpu_float_gemm import FLOAT_GEMM_MIN_ROWS
from tests.support.cpu_marches import MARCHES, build_cpu_kernels

pytestmark = pytest.mark.skipif(shutil.which("cc") is None, reason="no C compiler")


@pytest.fixture(scope="module", params=MARCHES)
def kernels(request):
    kernels = build_cpu_kernels(request.param)
    if not kernels.packed_matmuls:
        pytest.skip("no packed products in this build")
    return kernels


def _rand(*shape: int, seed: int) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).to(torch.bfloat16)


def _count_calls(monkeypatch, kernels, name: str) -> list[tuple[int, int]]:
    """Records each (g0, ng) slab `kernels.<name>` (an unpack) is asked for."""
    calls, unpack = [], getattr(kernels, name)

    def counted(packed, g0=0, ng=None):
        calls.append((g0, ng))
        return unpack(packed, g0, ng)

    monkeypatch.setattr(kernels, name, counted)
    return calls


def test_only_the_avx2_form_from_the_threshold(kernels):
    assert kernels.takes_float_gemm(FLOAT_GEMM_MIN_ROWS) == (kernels.packed_isa == "avx2")
    assert not kernels.takes_float_gemm(FLOAT_GEMM_MIN_ROWS - 1)


def test_unpacks_are_the_exact_float32_transpose(kernels):
    weight = _rand(96, 70, seed=1)  # 35 k-pairs: an odd count
    packed = kernels.pack_vnni(weight)
    assert torch.equal(kernels.unpack_vnni(packed), weight.float().T)
    assert torch.equal(kernels.unpack_vnni(packed, 2, 3), weight.float().T[:, 32:80])
    if kernels.packed_isa != "avx2":
        return  # the 4-bit codes are in another order there (and never unpacked)
    gen = torch.Generator().manual_seed(2)
    for group_size in (32, 64):
        q = torch.randint(0, 16, (48, 128), generator=gen, dtype=torch.uint8)
        scale = (torch.rand(48, 128 // group_size, generator=gen) * 0.1).half().float()
        offset = (torch.randn(48, 128 // group_size, generator=gen) * 0.1).half().float()
        weight = q.float() * scale.repeat_interleave(group_size, 1) + offset.repeat_interleave(group_size, 1)
        packed = kernels.pack_int4(q, scale, offset, group_size)
        assert torch.equal(kernels.unpack_int4(packed), weight.T)
        assert torch.equal(kernels.unpack_int4(packed, 1, 2), weight.T[:, 16:48])


# slabs: None = one; 4 = the 6 column groups in slabs of 4 and 2
@pytest.mark.parametrize("rows,slab_groups,with_bias", [(FLOAT_GEMM_MIN_ROWS, None, True),
                                                        (FLOAT_GEMM_MIN_ROWS + 5, 4, True),
                                                        (FLOAT_GEMM_MIN_ROWS, 4, False),
                                                        (FLOAT_GEMM_MIN_ROWS - 1, None, True)])
def test_bf16_products(kernels, rows, slab_groups, with_bias, monkeypatch):
    if slab_groups:
        monkeypatch.setattr(cpu_float_gemm, "FLOAT_GEMM_SLAB_BYTES", 70 * 16 * 4 * slab_groups)
    calls = _count_calls(monkeypatch, kernels, "unpack_vnni")
    weight, bias = _rand(96, 70, seed=3), _rand(96, seed=4) if with_bias else None
    x = _rand(rows, 140, seed=5)[:, :70]  # strided rows
    want = x.float() @ weight.float().T + (bias.float() if with_bias else 0.0)
    got = kernels.linear_vnni(x, kernels.pack_vnni(weight), bias, torch.float32)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    rounded = kernels.linear_vnni(x, kernels.pack_vnni(weight), bias)
    assert rounded.dtype == torch.bfloat16 and torch.equal(rounded, got.to(torch.bfloat16))
    slabs = [(0, 6)] if not slab_groups else [(0, 4), (4, 2)]
    assert calls == (2 * slabs if kernels.takes_float_gemm(rows) else [])


@pytest.mark.parametrize("group_size,slab_groups", [(32, None), (64, None), (32, 2)])
def test_4bit_products(kernels, group_size, slab_groups, monkeypatch):
    """x as given times the dequantized weight: the 4-bit kernel's 15-bit rounding of x (AVX2) would miss the
    tolerance below, so this also tells the GEMM ran."""
    if slab_groups:
        monkeypatch.setattr(cpu_float_gemm, "FLOAT_GEMM_SLAB_BYTES", 128 * 16 * 4 * slab_groups)
    calls = _count_calls(monkeypatch, kernels, "unpack_int4")
    gen = torch.Generator().manual_seed(6)
    q = torch.randint(0, 16, (48, 128), generator=gen, dtype=torch.uint8)
    scale = (torch.rand(48, 128 // group_size, generator=gen) * 0.1).half().float()
    offset = (torch.randn(48, 128 // group_size, generator=gen) * 0.1).half().float()
    weight = q.float() * scale.repeat_interleave(group_size, 1) + offset.repeat_interleave(group_size, 1)
    x, bias = _rand(FLOAT_GEMM_MIN_ROWS + 3, 256, seed=7)[:, :128], _rand(48, seed=8)  # strided rows
    got = kernels.linear_int4(x, kernels.pack_int4(q, scale, offset, group_size), bias, torch.float32)
    if kernels.packed_isa == "avx2":
        torch.testing.assert_close(got, x.float() @ weight.T + bias.float(), rtol=1e-5, atol=1e-4)
        assert calls == ([(0, 3)] if not slab_groups else [(0, 2), (2, 1)])
    else:  # the kernel: x rounded to bf16 only, the codes exact (test_cpu_ops.py checks it closely)
        torch.testing.assert_close(got, x.float() @ weight.T + bias.float(), rtol=1e-3, atol=2e-3)
        assert calls == []
