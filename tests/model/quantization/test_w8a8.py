"""compressed-tensors checkpoints written in-test as llm-compressor writes them (`_ct_checkpoints.py`):
W8A8 int8 (`int-quantized`, aserve/model/quantization/w8a8.py) served with int8 activations and matching
a plain torch reference of those semantics; FP8 (`float-quantized`, served weight-only by fp8.py) and W8A16
(`pack-quantized` 8-bit channel, the int8 kernel) matching their dequantized fp32 copies; `ignore`
entries (`re:` regexes included) leaving modules float."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file

from aserve.model.layers.linear import Linear
from aserve.model.quantization.assign import linear_layers
from aserve.model.quantization.int4_cpu import FP32_KERNEL_MAX_ROWS
from aserve.model.quantization.unquantized import UnquantizedLinearMethod
from aserve.model.quantization.w8a8 import W8A8Int8Method, w8a8_linear, w8a8_reference
from tests.model._parity import greedy_generate
from tests.model._tiny_models import load_ours, run_schedule
from tests.model.quantization._ct_checkpoints import STATIC_INPUT_SCALE, build_ct

PROMPTS = [[3, 17, 99, 5, 42, 7, 8, 250, 31, 4, 11], [9, 8, 7, 11]]
STEPS = [[(0, 6), (1, 3)], [(0, 4)], [(0, 1), (1, 1)]]
DOWN = "model.layers.0.mlp.down_proj"


class FakeQuantReference(UnquantizedLinearMethod):
    """The W8A8 semantics on a dequantized float weight: each input row rounded to its int8 grid
    (`amax / 127` per row, or a static scale), then `F.linear` in fp64."""

    name = "reference"

    def __init__(self, input_scale: float | None = None):
        self.input_scale = input_scale

    def apply(self, layer, x, bias):
        x64 = x.double()
        if self.input_scale is None:
            a = x64.abs().amax(-1, keepdim=True) / 127
            a = torch.where(a > 0, a, torch.ones_like(a))
        else:
            a = torch.tensor(self.input_scale, dtype=torch.float64)
        xq = torch.round(x64 / a).clamp(-128, 127) * a
        return F.linear(xq, layer.weight.double(), None if bias is None else bias.double()).to(x.dtype)


def _reference_model(deq, input_scale: float | None = None, skip: tuple[str, ...] = ()):
    ref = load_ours(deq, "float32")
    for name, layer in linear_layers(ref):
        if not any(name.startswith(s) for s in skip):
            layer.quant_method = FakeQuantReference(input_scale)
    return ref


def _assert_close_outputs(ours, ref, tol=1e-4):
    got, want = run_schedule(ours, PROMPTS, STEPS, 16), run_schedule(ref, PROMPTS, STEPS, 16)
    for a, b in zip(got, want, strict=True):
        torch.testing.assert_close(a, b, rtol=tol, atol=tol)


# ---- the Linear method ----------------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [1, 16, 37])
@pytest.mark.parametrize("static", [False, True])
def test_w8a8_linear_is_the_reference(dtype, rows, static):
    gen = torch.Generator().manual_seed(rows)
    q = torch.randint(-128, 128, (40, 72), generator=gen, dtype=torch.int8)
    w_scale = torch.rand(40, generator=gen) * 0.01
    bias = torch.randn(40, generator=gen).to(dtype)
    x = torch.randn(2, rows, 72, generator=gen).to(dtype)
    x[0, 0] = 0  # an all-zero row stays zero
    input_scale = torch.tensor(0.01) if static else None
    got = w8a8_linear(x, q, w_scale, input_scale, bias)
    assert got.dtype == dtype and got.shape == (2, rows, 40)
    torch.testing.assert_close(got, w8a8_reference(x, q, w_scale, input_scale, bias), rtol=1e-5, atol=1e-5)


def test_w8a8_reference_quantizes_the_activations():
    gen = torch.Generator().manual_seed(0)
    q = torch.randint(-127, 128, (8, 64), generator=gen, dtype=torch.int8)
    w_scale = torch.full((8,), 0.01)
    x = torch.randn(3, 64, generator=gen)
    exact = F.linear(x.double(), q.double() * 0.01).float()
    got = w8a8_reference(x, q, w_scale)
    assert not torch.allclose(got, exact, rtol=1e-6, atol=1e-6)  # activation rounding is visible
    a = x.abs().amax(1, keepdim=True) / 127
    torch.testing.assert_close(got, F.linear((torch.round(x / a) * a).double(), q.double() * 0.01).float())


def test_a_static_fused_layer_uses_the_largest_shard_input_scale():
    layer = Linear(16, 8)
    layer.set_quant_method(W8A8Int8Method(static=True))
    layer.w8a8_input_scale.data.copy_(torch.tensor([0.5] * 4 + [2.0] * 4))
    layer.process_weights_after_loading()
    assert layer.w8a8_input_scale.shape == () and float(layer.w8a8_input_scale) == 2.0


def _served_with(tmp_path, scheme: str, method: str):
    """(our fp32 model of a `scheme` checkpoint, the dequantized folder, its Linear layers), checking
    every Linear got `method`."""
    quant, deq = build_ct(tmp_path, scheme)
    ours = load_ours(quant, "float32")
    layers = linear_layers(ours)
    assert {layer.quant_method.name for _, layer in layers} == {method}
    return ours, deq, layers


# ---- W8A8 checkpoints -----------------------------------------------------------------------------------
@pytest.mark.parametrize("scheme", ["w8a8", "w8a8_static"])
def test_w8a8_checkpoint_matches_the_reference_semantics(tmp_path, scheme):
    ours, deq, layers = _served_with(tmp_path, scheme, "w8a8_int8")
    assert all(layer.w8a8_weight.dtype == torch.int8 for _, layer in layers)  # 1 byte a weight resident
    assert not any(hasattr(layer, "weight") for _, layer in layers)
    static = STATIC_INPUT_SCALE if scheme == "w8a8_static" else None
    _assert_close_outputs(ours, _reference_model(deq, static))
    # the activation quantization matters: without it the outputs differ
    got = run_schedule(ours, PROMPTS, STEPS, 16)
    plain = run_schedule(load_ours(deq, "float32"), PROMPTS, STEPS, 16)
    assert not all(torch.allclose(a, b, rtol=1e-4, atol=1e-4) for a, b in zip(got, plain, strict=True))


def test_w8a8_checkpoint_in_bf16_follows_fp32(tmp_path):
    quant, _ = build_ct(tmp_path, "w8a8")
    ours, ref = load_ours(quant, "bfloat16"), load_ours(quant, "float32")
    assert greedy_generate(ours, PROMPTS, 6) == greedy_generate(ref, PROMPTS, 6)


@pytest.mark.parametrize("scheme", ["w8a8", "fp8", "w8a16"])
def test_a_checkpoint_with_a_wrong_scale_changes_the_output(tmp_path, scheme):
    """The scales are really read: flipping down_proj's per-channel scales moves the outputs away from
    the dequantized reference (W8A8's reference also quantizes activations)."""
    quant, deq = build_ct(tmp_path, scheme)
    state = load_file(str(quant / "model.safetensors"))
    state[f"{DOWN}.weight_scale"] = state[f"{DOWN}.weight_scale"].flip(0).contiguous()
    save_file(state, str(quant / "model.safetensors"), metadata={"format": "pt"})
    got = run_schedule(load_ours(quant, "float32"), PROMPTS, STEPS, 16)
    reference = _reference_model(deq) if scheme == "w8a8" else load_ours(deq, "float32")
    want = run_schedule(reference, PROMPTS, STEPS, 16)
    assert not all(torch.allclose(a, b, rtol=1e-4, atol=1e-4) for a, b in zip(got, want, strict=True))


def test_a_regex_ignore_entry_leaves_the_module_float(tmp_path):
    quant, deq = build_ct(tmp_path, "w8a8", ignore=("lm_head", r"re:.*layers\.0\.mlp\.down_proj"), keep_float=(DOWN,))
    ours = load_ours(quant, "float32")
    methods = {name: layer.quant_method.name for name, layer in linear_layers(ours)}
    assert methods.pop(DOWN) == "unquantized" and set(methods.values()) == {"w8a8_int8"}
    _assert_close_outputs(ours, _reference_model(deq, skip=(DOWN,)))


@pytest.mark.parametrize("entry", [r"re:.*mlp\.down_proj", "model.layers.1.mlp.down_proj"])
def test_an_ignored_module_stored_quantized_is_refused(tmp_path, entry):
    quant, _ = build_ct(tmp_path, "w8a8", ignore=("lm_head", entry))
    with pytest.raises(ValueError, match="ignore list"):
        load_ours(quant, "float32")


# ---- FP8 and W8A16 compressed-tensors checkpoints ------------------------------------------------------
@pytest.mark.parametrize("scheme", ["fp8", "fp8_static"])
def test_ct_fp8_checkpoint_is_served_weight_only_like_fp8_checkpoints(tmp_path, scheme):
    ours, deq, layers = _served_with(tmp_path, scheme, "fp8")
    assert all(layer.fp8_weight.dtype == torch.float8_e4m3fn for _, layer in layers)
    _assert_close_outputs(ours, load_ours(deq, "float32"))  # activations unquantized on CPU


def test_ct_w8a16_channel_checkpoint_runs_on_the_int8_kernel(tmp_path):
    ours, deq, layers = _served_with(tmp_path, "w8a16", "compressed-tensors")
    assert all(layer.int8_weight.dtype == torch.int8 and not hasattr(layer, "weight") for _, layer in layers)
    ref = load_ours(deq, "float32")
    assert FP32_KERNEL_MAX_ROWS < 9  # the 9-row first step dequantizes on the fly; the 2-row decode is the kernel
    _assert_close_outputs(ours, ref)


def test_ct_w8a16_group_checkpoint_stays_dequantized(tmp_path):
    quant, deq = build_ct(tmp_path, "w8a16_group", group_size=32)
    ours = load_ours(quant, "float32")
    assert all(layer.weight.dtype == torch.float32 for _, layer in linear_layers(ours))
    _assert_close_outputs(ours, load_ours(deq, "float32"))


def test_all_zero_zero_points_are_dropped_non_zero_refused():
    from aserve.model.quantization.w8a8 import w8a8_canonical

    q = torch.randint(-127, 128, (8, 16), dtype=torch.int8)
    parts = {"weight": q, "weight_scale": torch.rand(8, 1) + 0.1, "input_scale": torch.tensor([0.5]),
             "weight_zero_point": torch.zeros(8, 1, dtype=torch.int8), "input_zero_point": torch.zeros(1, dtype=torch.int8)}
    out = w8a8_canonical(parts, static=True, where="m")
    assert set(out) == {"w8a8_weight", "w8a8_scale", "w8a8_input_scale"} and torch.equal(out["w8a8_weight"], q)
    with pytest.raises(ValueError, match="non-zero input_zero_point"):
        w8a8_canonical({**parts, "input_zero_point": torch.ones(1, dtype=torch.int8)}, static=True, where="m")
