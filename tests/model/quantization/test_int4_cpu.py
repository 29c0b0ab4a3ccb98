import pytest
import torch
from torch import nn

from aserve.model.quantization.int4_cpu import (
    FP32_KERNEL_MAX_ROWS,
    dequantize_int4,
    int4_linear,
    int4_packable,
    pack_int4,
    quantize_int4,
)


def _weights(n=48, k=96, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(n, k, generator=gen) * 0.1 + torch.randn(n, 1, generator=gen) * 0.05


def test_quantize_int4_error_is_at_most_half_a_step():
    w = _weights()
    q, scale, zero = quantize_int4(w)
    assert q.dtype == torch.uint8 and int(q.min()) >= 0 and int(q.max()) <= 15
    err = (dequantize_int4(q, scale, zero) - w).abs().reshape(48, 3, 32)
    assert bool((err <= scale.unsqueeze(-1) / 2 + 1e-6).all())


def test_constant_group_is_exact():
    w = torch.full((16, 64), 0.25)
    torch.testing.assert_close(dequantize_int4(*quantize_int4(w)), w)


@pytest.mark.parametrize("rows", [1, FP32_KERNEL_MAX_ROWS, FP32_KERNEL_MAX_ROWS + 3])
def test_fp32_activations_reproduce_the_dequantized_weight(rows):
    w = _weights()
    q, scale, zero = quantize_int4(w)
    layer = nn.Module()
    pack_int4(layer, q, scale, zero, torch.float32)
    x = torch.randn(rows, 96)
    bias = torch.randn(48)
    want = x @ dequantize_int4(q, scale, zero).T + bias
    torch.testing.assert_close(int4_linear(layer, x, 32, bias), want, rtol=1e-5, atol=1e-5)
    # Leading dims are kept.
    assert int4_linear(layer, x.reshape(rows, 1, 96), 32, None).shape == (rows, 1, 48)


def test_bf16_activations_are_close():
    w = _weights()
    q, scale, zero = quantize_int4(w)
    layer = nn.Module()
    pack_int4(layer, q, scale, zero, torch.bfloat16)
    x = torch.randn(7, 96)
    want = x @ dequantize_int4(q, scale, zero).T
    got = int4_linear(layer, x.bfloat16(), 32, None)
    assert got.dtype == torch.bfloat16
    assert float((got.float() - want).norm() / want.norm()) < 1e-2


def test_bf16_with_the_c_kernel_rounds_only_the_activations():
    """aserve's C int4 kernel (bf16, groups of 32): with AVX512-BF16, sums of codes x activations are
    exact-product fp32 and the group scale is applied in fp32, so it matches fp32 math on the bf16-rounded
    activations; with AVX2 the activations are further rounded to 15-bit integers per 32 (integer dot
    products), far inside bf16's own rounding. torch's kernel (scales rounded to bf16, bf16 output) is the
    fallback elsewhere."""
    from aserve.kernels import cpu_ops

    kernels = cpu_ops.load()
    if kernels is None or not kernels.packed_matmuls:
        pytest.skip("no C kernel with packed products (AVX512-BF16 or AVX2) here")
    w = _weights()
    q, scale, zero = quantize_int4(w)
    layer = nn.Module()
    pack_int4(layer, q, scale, zero, torch.bfloat16)
    assert hasattr(layer, "int4_c_codes") and not hasattr(layer, "int4_weight")
    x = torch.randn(9, 96).bfloat16()
    want = x.float() @ dequantize_int4(q, scale, zero).T
    exact = kernels.packed_isa != "avx2"
    out_atol, f32_tol = (1e-6, 1e-5) if exact else (2e-3, 2e-3)
    torch.testing.assert_close(int4_linear(layer, x, 32, None).float(), want, rtol=2**-8, atol=out_atol)
    layer.float_output = True
    got = int4_linear(layer, x, 32, None)
    assert got.dtype == torch.float32
    torch.testing.assert_close(got, want, rtol=f32_tol, atol=f32_tol)
    compiled = torch.compile(lambda t: int4_linear(layer, t, 32, None), backend="eager", fullgraph=True)
    torch.testing.assert_close(compiled(x).float(), want, rtol=2**-8, atol=out_atol)


def test_packable_shapes():
    assert int4_packable(192, 576) and int4_packable(1536, 576)
    assert not int4_packable(40, 64)  # output rows must come in tiles of 16
    assert not int4_packable(64, 48)  # input must be whole groups of 32
