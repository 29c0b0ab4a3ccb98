"""The CUDA forms of the quantized-checkpoint methods (`aserve/model/quantization/cuda_linear.py`), run on
CPU tensors by patching `use_cuda_forms` (the Triton dequant-GEMM under the interpreter; torch's CPU
`_int_mm` / `_scaled_mm` wrapped to enforce their CUDA limits): each against its method's semantics, the
fallbacks where a shape or GPU does not fit, and the CPU forms untouched without the patch."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from aserve.model.layers.linear import Linear
from aserve.model.quantization import cuda_linear
from aserve.model.quantization.assign import linear_layers
from aserve.model.quantization.checkpoint_int import CheckpointIntMethod, dequantize, num_groups
from aserve.model.quantization.fp8 import Fp8CheckpointMethod, Fp8OnlineMethod, dequantize_fp8
from aserve.model.quantization.w8a8 import W8A8Int8Method, w8a8_reference
from tests.model._tiny_models import load_ours, run_schedule
from tests.model.quantization._quantized_checkpoints import build
from tests.support.triton_interpreter import requires_interpreter

PROMPTS = [[3, 17, 99, 5, 42, 7, 8, 250, 31, 4, 11], [9, 8, 7, 11]]
STEPS = [[(0, 6), (1, 3)], [(0, 4)], [(0, 1), (1, 1)]]


@pytest.fixture
def cuda_forms(monkeypatch):
    """The CUDA forms for CPU tensors, on a GPU with fp8 (patch `fp8_scaled_mm_available` to change that)."""
    requires_interpreter()
    monkeypatch.setattr(cuda_linear, "use_cuda_forms", lambda device: True)
    monkeypatch.setattr(cuda_linear, "fp8_scaled_mm_available", lambda device: True)
    return monkeypatch


def _checkpoint_layer(n, k, bits, group_size, sym, gen, perm=None):
    layer = Linear(k, n, bias=True)
    layer.set_quant_method(CheckpointIntMethod("gptq", bits, group_size))
    g = num_groups(k, group_size)
    codes = torch.randint(0, 2**bits, (n, k), generator=gen).to(torch.uint8)
    scales = torch.rand(n, g, generator=gen) * 0.02 + 0.001
    zeros = torch.full((n, g), float(2 ** (bits - 1))) if sym else torch.randint(0, 2**bits, (n, g), generator=gen).float()
    layer.qcodes.data.copy_(codes)
    layer.qscales.data.copy_(scales)
    layer.qzeros.data.copy_(zeros)
    layer.bias.data.copy_(torch.randn(n, generator=gen))
    if perm is not None:
        CheckpointIntMethod.set_input_perm(layer, perm, "test")
    return layer, dequantize(codes, scales, zeros, group_size)


# ---- gptq / awq / compressed-tensors: the Triton dequant-GEMM -----------------------------------------------
@pytest.mark.parametrize("bits, group_size, sym", [(4, 32, True), (4, 64, False), (4, -1, False), (8, 32, True),
                                                   (8, -1, True)])
def test_checkpoint_int_cuda_form_is_the_dequantized_linear(cuda_forms, bits, group_size, sym):
    gen = torch.Generator().manual_seed(bits * 100 + group_size)
    k = 96  # groups of 64: 64 + 32
    perm = torch.randperm(k, generator=gen)
    layer, w = _checkpoint_layer(48, k, bits, group_size, sym, gen, perm)
    layer.process_weights_after_loading()
    assert layer.dq_weight.dtype == torch.int32 and hasattr(layer, "dq_zeros") == (not sym)
    assert not any(hasattr(layer, a) for a in ("weight", "int8_weight", "int4_weight", "int4_c_codes", "qcodes"))
    x = torch.randn(2, 5, k, generator=gen)
    got = layer(x)
    assert got.shape == (2, 5, 48)
    torch.testing.assert_close(got, F.linear(x[..., perm], w, layer.bias), atol=1e-4, rtol=1e-4)


def test_checkpoint_int_group_size_the_cuda_kernel_cannot_take_keeps_the_dequantized_weight(cuda_forms):
    gen = torch.Generator().manual_seed(1)
    layer, w = _checkpoint_layer(32, 96, 4, 24, False, gen)
    layer.process_weights_after_loading()
    assert not hasattr(layer, "dq_weight") and torch.equal(layer.weight, w)


def test_checkpoint_int_cpu_forms_are_untouched_without_cuda():
    gen = torch.Generator().manual_seed(2)
    layer, _ = _checkpoint_layer(32, 64, 4, 32, False, gen)
    layer.process_weights_after_loading()
    assert not hasattr(layer, "dq_weight") and not hasattr(layer, "weight")
    layer8, _ = _checkpoint_layer(32, 64, 8, -1, True, gen)
    layer8.process_weights_after_loading()
    assert layer8.int8_weight.dtype == torch.int8 and not hasattr(layer8, "dq_weight")


def test_gptq_checkpoint_on_the_cuda_form_matches_its_dequantized_copy(cuda_forms, tmp_path):
    # act-order, asymmetric, v2 zeros; down_proj (K = 96) has a short last group of 32
    quant, deq = build(tmp_path, "gptq", group_size=64, desc_act=True, sym=False, v1=False, intermediate_size=96)
    ours = load_ours(quant, "float32")
    assert all(hasattr(layer, "dq_weight") for _, layer in linear_layers(ours))
    ref = load_ours(deq, "float32")
    for got, want in zip(run_schedule(ours, PROMPTS, STEPS, 16), run_schedule(ref, PROMPTS, STEPS, 16), strict=True):
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)


# ---- W8A8 int8: torch._int_mm within its CUDA limits --------------------------------------------------------
@pytest.fixture
def int_mm_calls(monkeypatch):
    """torch._int_mm wrapped to enforce CUDA's limits (> 16 rows, K and N multiples of 8, contiguous
    operands); records calls."""
    calls, real = [], torch._int_mm

    def checked(a, b):
        assert a.shape[0] > 16 and a.shape[1] % 8 == 0 and b.shape[1] % 8 == 0, (a.shape, b.shape)
        assert a.is_contiguous() and b.is_contiguous()
        calls.append((a.shape[0], b.shape[1]))
        return real(a, b)

    monkeypatch.setattr(torch, "_int_mm", checked)
    return calls


@pytest.mark.parametrize("n, k, fits", [(32, 64, True), (36, 60, False)])
@pytest.mark.parametrize("static", [False, True], ids=["dynamic", "static"])
def test_w8a8_cuda_form_is_the_reference(cuda_forms, int_mm_calls, n, k, fits, static):
    gen = torch.Generator().manual_seed(n + k)
    layer = Linear(k, n, bias=True)
    layer.set_quant_method(W8A8Int8Method(static))
    q = torch.randint(-128, 128, (n, k), generator=gen).to(torch.int8)
    layer.w8a8_weight.data.copy_(q)
    layer.w8a8_scale.data.copy_(torch.rand(n, generator=gen) * 0.01 + 0.001)
    if static:
        layer.w8a8_input_scale.data.fill_(0.02)
    layer.bias.data.copy_(torch.randn(n, generator=gen))
    layer.process_weights_after_loading()
    assert layer.w8a8_cuda and torch.equal(layer.w8a8_weight_kn, q.t()) and not hasattr(layer, "w8a8_weight")
    for rows in (1, 16, 17, 40):
        x = torch.randn(rows, k, generator=gen)
        want = w8a8_reference(x, q, layer.w8a8_scale, getattr(layer, "w8a8_input_scale", None), layer.bias)
        torch.testing.assert_close(layer(x), want, atol=1e-5, rtol=1e-5)
    assert int_mm_calls == ([(32, n), (32, n), (32, n), (64, n)] if fits else [])  # rows padded to 32s


def test_w8a8_cuda_form_falls_back_where_cublas_refuses_the_shape(cuda_forms, monkeypatch, caplog):
    # cuBLASLt on an H200 refused a 248-row int8 product (CUBLAS_STATUS_NOT_SUPPORTED): same result, logged
    gen = torch.Generator().manual_seed(7)
    layer = Linear(64, 32, bias=False)
    layer.set_quant_method(W8A8Int8Method(False))
    q = torch.randint(-128, 128, (32, 64), generator=gen).to(torch.int8)
    layer.w8a8_weight.data.copy_(q)
    layer.w8a8_scale.data.copy_(torch.rand(32, generator=gen) * 0.01 + 0.001)
    layer.process_weights_after_loading()

    def refuses(a, b):
        raise RuntimeError("CUDA error: CUBLAS_STATUS_NOT_SUPPORTED when calling cublasLtMatmul")

    monkeypatch.setattr(torch, "_int_mm", refuses)
    x = torch.randn(5, 64, generator=gen)
    with caplog.at_level("INFO", logger="aserve.model.quantization.cuda_linear"):
        got = layer(x)
    torch.testing.assert_close(got, w8a8_reference(x, q, layer.w8a8_scale, None, None), atol=1e-5, rtol=1e-5)
    assert "torch._int_mm refused" in caplog.text


# ---- FP8: torch._scaled_mm with per-token fp8 activations --------------------------------------------------
def _scaled_mm_runs_here() -> bool:
    a = torch.ones(16, 16).to(torch.float8_e4m3fn)
    one = torch.ones(())
    try:
        torch._scaled_mm(a, a.t(), scale_a=one, scale_b=one, out_dtype=torch.float32)
    except (RuntimeError, NotImplementedError):
        return False
    return True


needs_scaled_mm = pytest.mark.skipif(not _scaled_mm_runs_here(), reason="torch._scaled_mm has no fp8 CPU form here")


@pytest.fixture
def scaled_mm_calls(monkeypatch):
    """torch._scaled_mm wrapped to enforce CUDA's limits (K, N multiples of 16, column-major mat2)."""
    calls, real = [], torch._scaled_mm

    def checked(a, b, **kw):
        assert a.shape[1] % 16 == 0 and b.shape[1] % 16 == 0 and b.stride(0) == 1, (a.shape, b.shape, b.stride())
        calls.append(a.shape[0])
        return real(a, b, **kw)

    monkeypatch.setattr(torch, "_scaled_mm", checked)
    return calls


def _online_fp8_layer(n, k, gen):
    layer = Linear(k, n, bias=True)
    layer.set_quant_method(Fp8OnlineMethod())
    layer.weight.data.copy_(torch.randn(n, k, generator=gen) * k**-0.5)
    layer.bias.data.copy_(torch.randn(n, generator=gen))
    return layer


@needs_scaled_mm
def test_fp8_cuda_form_quantizes_activations_per_token(cuda_forms, scaled_mm_calls):
    gen = torch.Generator().manual_seed(3)
    layer = _online_fp8_layer(48, 64, gen)
    layer.process_weights_after_loading()
    assert layer.fp8_scaled_mm
    x = torch.randn(3, 7, 64, generator=gen)
    got = layer(x)
    want = cuda_linear.fp8_scaled_reference(x, layer.fp8_weight, layer.fp8_scale, layer.bias)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    assert scaled_mm_calls == [21]
    # fp8 activations: close to the weight-only product, but not equal to it
    weight_only = F.linear(x, dequantize_fp8(layer.fp8_weight, layer.fp8_scale, 64), layer.bias)
    assert 0 < float((got - weight_only).abs().max()) < 0.1 * float(weight_only.abs().max())


def test_fp8_without_scaled_mm_keeps_the_dequantizing_form(cuda_forms, scaled_mm_calls):
    gen = torch.Generator().manual_seed(4)
    old_gpu = _online_fp8_layer(48, 64, gen)
    odd_shape = _online_fp8_layer(48, 40, gen)  # K not a multiple of 16
    block = Linear(64, 48)
    block.set_quant_method(Fp8CheckpointMethod(block_k=32))
    block.fp8_weight.data.copy_(torch.randn(48, 64, generator=gen).to(torch.float8_e4m3fn))
    block.fp8_scale.data.copy_(torch.rand(48, 2, generator=gen))
    cuda_forms.setattr(cuda_linear, "fp8_scaled_mm_available", lambda device: False)  # compute capability < 8.9
    old_gpu.process_weights_after_loading()
    cuda_forms.setattr(cuda_linear, "fp8_scaled_mm_available", lambda device: True)
    odd_shape.process_weights_after_loading()
    block.process_weights_after_loading()
    for layer in (old_gpu, odd_shape, block):
        assert not getattr(layer, "fp8_scaled_mm", False)
        x = torch.randn(5, layer.input_size, generator=gen)
        w = dequantize_fp8(layer.fp8_weight, layer.fp8_scale, layer.fp8_group_size)
        torch.testing.assert_close(layer(x), F.linear(x, w, layer.bias), atol=0, rtol=0)
    assert scaled_mm_calls == []
