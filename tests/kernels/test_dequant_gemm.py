"""The W4A16 / W8A16 dequant-GEMM (`aserve/kernels/dequant_gemm.py`) against its torch reference
(`reference.dequant_gemm`, which unpacks the same words) and against `F.linear` of the weight dequantized
from the canonical codes (`checkpoint_int.dequantize`, which checks the packing); a weight packed in
another order must not match. Interpreted on CPU in fp32 and fp16 (bf16 `tl.dot` is wrong under the
interpreter: the `gpu`-marked test checks bf16 on CUDA)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from aserve.kernels import reference
from aserve.kernels.dequant_gemm import block_config, dequant_gemm, pack_codes
from aserve.model.quantization.checkpoint_int import dequantize, num_groups

SHAPES = [(64, 128), (40, 100)]  # (N, K): multiples of the blocks, and neither (K not even a word multiple)
TOL = {torch.float32: {"atol": 1e-4, "rtol": 1e-4}, torch.float16: {"atol": 3e-3, "rtol": 3e-3},
       torch.bfloat16: {"atol": 2e-2, "rtol": 2e-2}}


def _case(n: int, k: int, bits: int, group_size: int, sym: bool, gen: torch.Generator):
    """Canonical codes uint8 [N, K], scales / zeros fp32 [N, G] (sym: every zero 2**(bits-1))."""
    g = num_groups(k, group_size)
    codes = torch.randint(0, 2**bits, (n, k), generator=gen).to(torch.uint8)
    scales = torch.rand(n, g, generator=gen) * (0.4 / 2**bits) + 0.01 / 2**bits
    if sym:
        zeros = torch.full((n, g), float(2 ** (bits - 1)))
    else:
        zeros = torch.randint(0, 2**bits, (n, g), generator=gen).float()
    return codes, scales, zeros


def _kernel_form(codes, scales, zeros, bits, sym):
    return pack_codes(codes, bits), scales.t().contiguous(), None if sym else zeros.t().contiguous()


def _canonical_linear(x, codes, scales, zeros, group_size, bias=None):
    """F.linear of the canonical weight rounded to x's dtype, in fp32, result in x's dtype."""
    w = dequantize(codes, scales, zeros, group_size).to(x.dtype).float()
    return F.linear(x.float(), w, None if bias is None else bias.float()).to(x.dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("sym", [True, False], ids=["sym", "asym"])
@pytest.mark.parametrize("group_size", [32, 128, -1])
@pytest.mark.parametrize("n, k", SHAPES)
@pytest.mark.parametrize("m", [1, 7, 33])
def test_w4a16_matches_reference_and_dequantized_linear(m, n, k, group_size, sym, dtype, device, gen):
    codes, scales, zeros = _case(n, k, 4, group_size, sym, gen)
    x = torch.randn(m, k, generator=gen).to(dtype)
    qweight, s, z = _kernel_form(codes, scales, zeros, 4, sym)
    args = [t.to(device) if t is not None else None for t in (x, qweight, s, z)]
    got = dequant_gemm(*args, 4, group_size).cpu()
    assert got.dtype == dtype and got.shape == (m, n)
    torch.testing.assert_close(got, reference.dequant_gemm(x, qweight, s, z, 4, group_size), **TOL[dtype])
    torch.testing.assert_close(got, _canonical_linear(x, codes, scales, zeros, group_size), **TOL[dtype])


@pytest.mark.parametrize("sym", [True, False], ids=["sym", "asym"])
@pytest.mark.parametrize("group_size", [32, -1])
@pytest.mark.parametrize("n, k", SHAPES)
def test_w8a16_matches_reference_and_dequantized_linear(n, k, group_size, sym, device, gen):
    codes, scales, zeros = _case(n, k, 8, group_size, sym, gen)
    x = torch.randn(7, k, generator=gen)
    qweight, s, z = _kernel_form(codes, scales, zeros, 8, sym)
    assert qweight.shape == (-(-k // 4), n)
    got = dequant_gemm(*[t.to(device) if t is not None else None for t in (x, qweight, s, z)], 8, group_size).cpu()
    torch.testing.assert_close(got, reference.dequant_gemm(x, qweight, s, z, 8, group_size), **TOL[torch.float32])
    torch.testing.assert_close(got, _canonical_linear(x, codes, scales, zeros, group_size), **TOL[torch.float32])


def test_bias_strided_rows_and_a_short_last_group(device, gen):
    # K = 80 with groups of 32: 32 + 32 + 16 (GPTQ's ceil(K / group) groups); x rows strided (a slice)
    n, k, gs = 48, 80, 32
    codes, scales, zeros = _case(n, k, 4, gs, False, gen)
    wide = torch.randn(5, k + 24, generator=gen)
    x = wide[:, 8:8 + k]
    bias = torch.randn(n, generator=gen)
    qweight, s, z = _kernel_form(codes, scales, zeros, 4, False)
    got = dequant_gemm(x.to(device), qweight.to(device), s.to(device), z.to(device), 4, gs, bias.to(device)).cpu()
    torch.testing.assert_close(got, _canonical_linear(x, codes, scales, zeros, gs, bias), **TOL[torch.float32])
    torch.testing.assert_close(got, reference.dequant_gemm(x, qweight, s, z, 4, gs, bias), **TOL[torch.float32])


def test_a_weight_packed_in_another_order_does_not_match(device, gen):
    n, k, gs = 64, 128, 32
    codes, scales, zeros = _case(n, k, 4, gs, False, gen)
    x = torch.randn(7, k, generator=gen)
    want = _canonical_linear(x, codes, scales, zeros, gs)
    # AWQ's interleaved nibble order within each word, and the first code in the highest nibble
    runs = codes.view(n, k // 8, 8)
    awq_order, reversed_order = runs[..., [0, 2, 4, 6, 1, 3, 5, 7]].reshape(n, k), runs.flip(-1).reshape(n, k)
    s, z = scales.t().contiguous(), zeros.t().contiguous()
    for wrong in (pack_codes(awq_order, 4), pack_codes(reversed_order, 4)):
        got = dequant_gemm(x.to(device), wrong.to(device), s.to(device), z.to(device), 4, gs).cpu()
        assert float((got - want).abs().max()) > 0.05
    right = dequant_gemm(x.to(device), pack_codes(codes, 4).to(device), s.to(device), z.to(device), 4, gs).cpu()
    torch.testing.assert_close(right, want, **TOL[torch.float32])


def test_arguments_that_do_not_fit_are_refused(gen):
    n, k = 32, 64
    codes, scales, zeros = _case(n, k, 4, 32, False, gen)
    x = torch.randn(3, k, generator=gen)
    qweight, s, z = _kernel_form(codes, scales, zeros, 4, False)
    with pytest.raises(ValueError, match="qweight"):  # AWQ / GPTQ on-disk layouts are not the kernel's
        dequant_gemm(x, pack_codes(codes, 4).t().contiguous(), s, z, 4, 32)
    with pytest.raises(ValueError, match="scales"):  # [N, G] instead of [G, N]
        dequant_gemm(x, qweight, scales, z, 4, 32)
    with pytest.raises(ValueError, match="zeros"):
        dequant_gemm(x, qweight, s, zeros, 4, 32)
    with pytest.raises(ValueError, match="group_size"):
        dequant_gemm(x, qweight, s, z, 4, 24)
    with pytest.raises(ValueError, match="bits"):
        dequant_gemm(x, qweight, s, z, 3, 32)
    with pytest.raises(ValueError, match="x"):
        dequant_gemm(x.to(torch.int32), qweight, s, z, 4, 32)


def test_pack_codes_round_trips_and_block_config_fits_the_group():
    codes = torch.randint(0, 16, (24, 37), generator=torch.Generator().manual_seed(0)).to(torch.uint8)
    assert torch.equal(reference.unpack_codes(pack_codes(codes, 4), 4, 37), codes.t().long())
    assert torch.equal(reference.unpack_codes(pack_codes(codes, 8), 8, 37), codes.t().long())
    for m in (1, 16, 17, 33, 500):
        for gs in (16, 32, 48, 64, 128, -1):
            block_m, block_n, block_k = block_config(m, gs)
            assert block_m >= min(m, 16) and block_n >= 16 and (gs == -1 or gs % block_k == 0)


@pytest.mark.gpu
@pytest.mark.parametrize("sym", [True, False], ids=["sym", "asym"])
@pytest.mark.parametrize("m", [1, 7, 33, 300])
def test_bf16_on_cuda(m, sym, gen):
    n, k, gs = 4096 + 64, 4096, 128
    codes, scales, zeros = _case(n, k, 4, gs, sym, gen)
    x = torch.randn(m, k, generator=gen).to(torch.bfloat16)
    qweight, s, z = _kernel_form(codes, scales, zeros, 4, sym)
    got = dequant_gemm(*[t.cuda() if t is not None else None for t in (x, qweight, s, z)], 4, gs).cpu()
    torch.testing.assert_close(got, reference.dequant_gemm(x, qweight, s, z, 4, gs), **TOL[torch.bfloat16])
