"""bitsandbytes (aserve/model/quantization/bitsandbytes.py) on the trained tiny Llama (tests/support/trained_tiny.py):
in-flight `--quantization bitsandbytes` keeps every Linear in 4 bits and computes exactly what the model whose
weights are bnb's own `dequantize_4bit` of the same NF4 quantization computes (same greedy tokens in fp32,
top-1 >= 99% in bf16); checkpoints that transformers + bitsandbytes quantize and save on this CPU (nf4 with
double quant, fp4, LLM.int8() 8-bit) are served with no flags and give the same greedy tokens as transformers
running that quantized model and as its dequantized copy."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from aserve.model.quantization.assign import expert_layers, linear_layers
from tests.model._parity import greedy_generate, teacher_forced_parity
from tests.model._tiny_models import load_ours, run_schedule
from tests.model.quantization._bnb_checkpoints import build_bnb, float_copy
from tests.support.trained_tiny import markov_sequences

bnb = pytest.importorskip("bitsandbytes")
bnbf = pytest.importorskip("bitsandbytes.functional")

PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
PROMPTS = markov_sequences(3, 12, seed=11).tolist()
STEPS = [[(0, 6), (1, 5), (2, 12)], [(0, 1), (1, 7)], [(0, 5)]]  # chunks, decodes and a whole prompt
NEW_TOKENS = 12


@pytest.fixture(scope="module")
def trained(trained_tiny_llama) -> Path:
    return Path(trained_tiny_llama)


def _is_projection(name: str) -> bool:
    parts = name.split(".")
    return len(parts) >= 3 and parts[-2] in PROJECTIONS and parts[-1] == "weight"


def _check_same(ours, ref) -> None:
    for got, want in zip(run_schedule(ours, PROMPTS, STEPS, 16), run_schedule(ref, PROMPTS, STEPS, 16), strict=True):
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    assert greedy_generate(ours, PROMPTS, NEW_TOKENS) == greedy_generate(ref, PROMPTS, NEW_TOKENS)


def _check_4bit_resident(model) -> None:
    layers = linear_layers(model)
    assert {layer.quant_method.name for _, layer in layers} == {"bitsandbytes"}
    for _, layer in layers:
        assert layer.bnb_packed.dtype == torch.uint8 and tuple(layer.bnb_packed.shape) == (
            layer.output_size, layer.input_size // 2)  # two 4-bit codes a byte
        assert getattr(layer, "weight", None) is None


# ---- in-flight ---------------------------------------------------------------------------------------------
def _bnb_rounded_copy(src: Path, out: Path) -> Path:
    """The float model whose projections are bnb's dequantize_4bit of its own NF4 quantization (blocks of 64)."""
    rounded = {}
    for name, w in load_file(str(src / "model.safetensors")).items():
        if _is_projection(name):
            packed, state = bnbf.quantize_4bit(w.float().contiguous(), blocksize=64, quant_type="nf4")
            rounded[name] = bnbf.dequantize_4bit(packed, state)
    return float_copy(src, out, rounded)


def test_in_flight_nf4_equals_bnbs_dequantized_weights(trained, tmp_path):
    ours = load_ours(trained, "float32", quantization="bitsandbytes")
    _check_4bit_resident(ours)
    rounded = load_ours(_bnb_rounded_copy(trained, tmp_path / "rounded"), "float32")
    _check_same(ours, rounded)
    # and it is not the float model: the NF4 rounding is there
    plain = run_schedule(load_ours(trained, "float32"), PROMPTS, STEPS, 16)
    assert not all(torch.allclose(a, b, rtol=1e-4, atol=1e-4)
                   for a, b in zip(run_schedule(ours, PROMPTS, STEPS, 16), plain, strict=True))


def test_in_flight_nf4_top1(trained, tmp_path):
    rounded = load_ours(_bnb_rounded_copy(trained, tmp_path / "rounded"), "float32")
    sequences = markov_sequences(8, 48, seed=5).tolist()
    bf16 = load_ours(trained, "bfloat16", quantization="bitsandbytes")
    report = teacher_forced_parity(rounded, bf16, sequences, start=1)
    assert report.top1_agreement >= 0.99, str(report)
    fp32 = teacher_forced_parity(load_ours(trained, "float32"), load_ours(trained, "float32",
                                                                          quantization="bitsandbytes"), sequences, 1)
    assert fp32.top1_agreement >= 0.98, str(fp32)  # NF4 itself against the float model (99.7% here)


def test_load_format_bitsandbytes_is_in_flight_nf4(trained):
    _check_4bit_resident(load_ours(trained, "float32", load_format="bitsandbytes"))


# ---- pre-quantized checkpoints (transformers + bitsandbytes on this CPU) -----------------------------------
def _hf_greedy(hf_model, prompts: list[list[int]], max_new: int) -> list[list[int]]:
    outs = []
    with torch.inference_mode():
        for p in prompts:
            ids = torch.tensor([p])
            gen = hf_model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=max_new,
                                    min_new_tokens=max_new, pad_token_id=0)
            outs.append(gen[0, len(p):].tolist())
    return outs


_4BIT = {"load_in_4bit": True, "bnb_4bit_compute_dtype": torch.float32}
CASES = {"nf4-double-quant": {**_4BIT, "bnb_4bit_quant_type": "nf4", "bnb_4bit_use_double_quant": True},
         "fp4": {**_4BIT, "bnb_4bit_quant_type": "fp4"},
         "fp4-double-quant": {**_4BIT, "bnb_4bit_quant_type": "fp4", "bnb_4bit_use_double_quant": True},
         "nf4": {**_4BIT, "bnb_4bit_quant_type": "nf4"}}


@pytest.mark.parametrize("case", list(CASES))
def test_prequantized_4bit_checkpoint_same_greedy_tokens(trained, tmp_path, case):
    quant, deq, hf_model = build_bnb(trained, tmp_path, **CASES[case])
    ours = load_ours(quant, "float32")  # no flags: config.json's quantization_config
    _check_4bit_resident(ours)
    _check_same(ours, load_ours(deq, "float32"))
    # transformers runs the quantized model through bnb's CPU kernels (bf16 activations inside)
    assert greedy_generate(ours, PROMPTS, NEW_TOKENS) == _hf_greedy(hf_model, PROMPTS, NEW_TOKENS)


def test_prequantized_4bit_checkpoint_bf16_top1(trained, tmp_path):
    quant, deq, _ = build_bnb(trained, tmp_path, **CASES["nf4-double-quant"])
    report = teacher_forced_parity(load_ours(deq, "float32"), load_ours(quant, "bfloat16"),
                                   markov_sequences(8, 48, seed=5).tolist(), start=1)
    assert report.top1_agreement >= 0.99, str(report)


def test_fused_layers_keep_each_shards_quant_state(trained, tmp_path):
    quant, _, hf_model = build_bnb(trained, tmp_path, **CASES["nf4-double-quant"])
    qkv = dict(linear_layers(load_ours(quant, "float32")))["model.layers.0.self_attn.qkv_proj"]
    attn = hf_model.model.layers[0].self_attn
    want = [bnbf.dequantize_blockwise(m.weight.quant_state.absmax, m.weight.quant_state.state2)
            + m.weight.quant_state.offset for m in (attn.q_proj, attn.k_proj, attn.v_proj)]
    assert len({float(w.mean()) for w in want}) == 3  # the shards' states differ: the test means something
    torch.testing.assert_close(qkv.bnb_state.absmax, torch.cat(want).float())


def test_prequantized_checkpoint_with_a_corrupted_absmax_changes_the_output(trained, tmp_path):
    quant, deq, _ = build_bnb(trained, tmp_path, **CASES["nf4-double-quant"])
    state = load_file(str(quant / "model.safetensors"))
    name = "model.layers.0.mlp.down_proj.weight.absmax"
    state[name] = state[name].flip(0).contiguous()
    save_file(state, str(quant / "model.safetensors"), metadata={"format": "pt"})
    got, want = (run_schedule(load_ours(p, "float32"), PROMPTS, STEPS, 16) for p in (quant, deq))
    assert not all(torch.allclose(a, b, rtol=1e-4, atol=1e-4) for a, b in zip(got, want, strict=True))


def test_prequantized_8bit_checkpoint_on_the_int8_kernel(trained, tmp_path):
    quant, deq, _ = build_bnb(trained, tmp_path, load_in_8bit=True)
    ours = load_ours(quant, "float32")
    layers = linear_layers(ours)
    assert {layer.quant_method.name for _, layer in layers} == {"bitsandbytes"}
    assert all(layer.int8_weight.dtype == torch.int8 for _, layer in layers)  # 1 byte a weight
    _check_same(ours, load_ours(deq, "float32"))


# ---- the layer, both kernels ---------------------------------------------------------------------------------
@pytest.mark.parametrize("dtype, n", [(torch.float32, 48), (torch.bfloat16, 48), (torch.bfloat16, 64)],
                         ids=["fp32", "bf16-dequantized", "bf16-fused"])  # fused: bf16, N % 32 == 0, AVX512-BF16
def test_in_flight_layer_computes_with_bnbs_dequantized_weight(dtype, n):
    from aserve.model.layers.linear import Linear
    from aserve.model.quantization.bitsandbytes import BnbInFlightMethod

    w, bias = torch.randn(n, 128) * 0.05, torch.randn(n)
    layer = Linear(128, n, bias=True, dtype=dtype)
    layer.set_quant_method(BnbInFlightMethod())
    layer.weight.data.copy_(w)
    layer.bias.data.copy_(bias)
    layer.process_weights_after_loading()
    packed, state = bnbf.quantize_4bit(w.to(dtype).float(), blocksize=64, quant_type="nf4")
    x = torch.randn(5, 128)
    want = x @ bnbf.dequantize_4bit(packed, state).T + bias.to(dtype).float()
    tol = {"rtol": 1e-5, "atol": 1e-5} if dtype == torch.float32 else {"rtol": 2e-2, "atol": 2e-2}
    torch.testing.assert_close(layer(x.to(dtype)).float(), want, **tol)


def test_missing_package_is_a_config_error_naming_pip_install(monkeypatch):
    import sys

    from aserve.config import ConfigError
    from aserve.model.quantization.bitsandbytes import bnb_functional

    monkeypatch.setitem(sys.modules, "bitsandbytes", None)
    monkeypatch.setitem(sys.modules, "bitsandbytes.functional", None)
    with pytest.raises(ConfigError, match="pip install bitsandbytes"):
        bnb_functional()


def test_in_flight_moe_experts_are_nf4_and_the_router_stays_float(tmp_path):
    from tests.support.tiny_models import GREEDY_STABLE, save_tiny_hf

    src = tmp_path / "src"
    save_tiny_hf(src, "mixtral", seed=0, **{**GREEDY_STABLE, "hidden_size": 64, "intermediate_size": 128})
    ours = load_ours(src, "float32", quantization="bitsandbytes")
    methods = {name.rsplit(".", 1)[-1]: layer.quant_method.name for name, layer in linear_layers(ours)}
    assert methods == {"qkv_proj": "bitsandbytes", "o_proj": "bitsandbytes", "gate": "unquantized"}
    assert {moe.quant_method.name for _, moe in expert_layers(ours)} == {"bitsandbytes"}
    rounded = {}
    for name, w in load_file(str(src / "model.safetensors")).items():
        if w.dim() == 2 and (".experts." in name or _is_projection(name)):
            packed, state = bnbf.quantize_4bit(w.float().contiguous(), blocksize=64, quant_type="nf4")
            rounded[name] = bnbf.dequantize_4bit(packed, state)
    ref = load_ours(float_copy(src, tmp_path / "rounded", rounded), "float32")
    prompts, steps = [[3, 17, 99, 5, 42, 7]], [[(0, 4)], [(0, 2)]]
    for got, want in zip(run_schedule(ours, prompts, steps, 16), run_schedule(ref, prompts, steps, 16), strict=True):
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)


def test_prequantized_layers_whose_k_is_not_a_multiple_of_64_load_dequantized(tmp_path):
    from tests.support.tiny_models import GREEDY_STABLE, save_tiny_hf

    src = tmp_path / "src"  # hidden 96: q/k/v, o and gate/up have K = 96 (bnb's blocks straddle rows); down K = 128
    save_tiny_hf(src, "llama", seed=0, **{**GREEDY_STABLE, "hidden_size": 96, "tie_word_embeddings": False})
    quant, deq, _ = build_bnb(src, tmp_path, **CASES["nf4-double-quant"])
    ours = load_ours(quant, "float32")
    methods = {name.rsplit(".", 1)[-1]: layer.quant_method.name for name, layer in linear_layers(ours)}
    assert methods == {"qkv_proj": "unquantized", "o_proj": "unquantized", "gate_up_proj": "unquantized",
                       "down_proj": "bitsandbytes"}
    _check_same(ours, load_ours(deq, "float32"))
