"""Every `aserve quantize` type end to end on the trained tiny Llama (tests/support/trained_tiny.py): quantize
on the CPU with llm-compressor, then serve the result with no flags. The checkpoint loads with a quantized
method on every decoder Linear (the LM head stays float), differs from the float model, agrees with it
teacher-forced (top-1 >= 95% for the 4-bit types, >= 98% for int8 / FP8), and aserve's greedy tokens equal
transformers' run of the float model with the checkpoint's weights unpacked and dequantized by the
compressed-tensors library (the weight-only types)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from aserve.model.quantization.assign import linear_layers
from aserve.server.cli import main as aserve_main
from tests.model._parity import greedy_generate, teacher_forced_parity
from tests.model._tiny_models import load_ours
from tests.support.trained_tiny import markov_sequences

pytest.importorskip("llmcompressor")

TOP1_FLOOR = {"gptq": 0.95, "awq": 0.95, "weight_only_int8": 0.98, "smooth_quant": 0.98, "fp8": 0.98}
CALIBRATED = {"gptq", "awq", "smooth_quant"}
# Where a type's weights live once served (the resident dtype of each decoder Linear's weight tensors).
RESIDENT_DTYPE = {"gptq": torch.uint8, "awq": torch.uint8, "weight_only_int8": torch.int8,
                  "smooth_quant": torch.int8, "fp8": torch.float8_e4m3fn}


@pytest.fixture(scope="module")
def calib_ids(tmp_path_factory) -> str:
    path = tmp_path_factory.mktemp("calib") / "ids.txt"
    path.write_text("\n".join(" ".join(map(str, s)) for s in markov_sequences(32, 64, seed=5).tolist()) + "\n")
    return str(path)


@pytest.fixture(scope="module")
def float_model(trained_llama):
    return load_ours(Path(trained_llama))


def _quantize(trained_llama: str, out: Path, quant_type: str, calib_ids: str, *extra: str) -> None:
    argv = ["quantize", "-i", trained_llama, "-o", str(out), "--quant-type", quant_type, *extra]
    if quant_type in CALIBRATED:
        argv += ["-token", calib_ids, "--num-calib-samples", "32"]
    assert aserve_main(argv) == 0


@pytest.fixture(scope="module")
def quantized(trained_llama, calib_ids, tmp_path_factory):
    """quant type -> its fp32 checkpoint, quantized once per module."""
    made: dict[str, Path] = {}

    def get(quant_type: str) -> Path:
        if quant_type not in made:
            out = tmp_path_factory.mktemp(quant_type) / "out"
            _quantize(trained_llama, out, quant_type, calib_ids, "-t", "fp32")
            made[quant_type] = out
        return made[quant_type]

    return get


def _resident_dtypes(layer) -> set[torch.dtype]:
    return {t.dtype for t in [*layer.parameters(recurse=False), *layer.buffers(recurse=False)]
            if t.dim() == 2 and t.shape[0] * t.shape[1] >= layer.output_size * layer.input_size // 8}


@pytest.mark.parametrize("quant_type", list(TOP1_FLOOR))
def test_quantized_checkpoint_serves_and_agrees_with_the_float_model(quantized, float_model, quant_type):
    out = quantized(quant_type)
    qc = json.loads((out / "config.json").read_text())["quantization_config"]
    assert qc["quant_method"] == "compressed-tensors" and "lm_head" in qc["ignore"]
    served = load_ours(out)
    layers = linear_layers(served)
    assert len(layers) == 2 * 4  # qkv, o, gate_up, down per layer (fused as aserve serves them)
    for name, layer in layers:
        assert layer.quant_method.name not in ("unquantized", "cpu_packed_bf16"), name
        assert RESIDENT_DTYPE[quant_type] in _resident_dtypes(layer), (name, _resident_dtypes(layer))
    sequences = markov_sequences(8, 48, seed=77).tolist()
    report = teacher_forced_parity(float_model, served, sequences, start=1)
    assert report.top1_agreement >= TOP1_FLOOR[quant_type], str(report)
    assert report.mean_kl > 0  # the weights were rounded: not the float model again
    assert report.mean_kl <= 0.05, str(report)


def _dequantized_by_compressed_tensors(trained_llama: str, out: Path):
    """The float HF model whose Linear weights are the checkpoint's, unpacked and dequantized by the
    compressed-tensors library itself (an implementation independent of aserve's readers)."""
    from compressed_tensors.compressors.pack_quantized.helpers import unpack_from_int32
    from compressed_tensors.quantization import QuantizationArgs
    from compressed_tensors.quantization.lifecycle.forward import dequantize
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    qc = json.loads((out / "config.json").read_text())["quantization_config"]
    (group,) = qc["config_groups"].values()
    args = QuantizationArgs(**group["weights"])
    state = load_file(str(out / "model.safetensors"))
    model = AutoModelForCausalLM.from_pretrained(trained_llama, dtype=torch.float32).eval()
    params = dict(model.named_parameters())
    for name in [n for n in state if n.endswith(".weight_packed")]:
        prefix = name[: -len(".weight_packed")]
        shape = torch.Size(state[f"{prefix}.weight_shape"].tolist())
        codes = unpack_from_int32(state[name], args.num_bits, shape, packed_dim=1)
        scale = state[f"{prefix}.weight_scale"]
        zero = state.get(f"{prefix}.weight_zero_point")
        if zero is not None:
            zero = unpack_from_int32(zero, args.num_bits, scale.shape, packed_dim=0)
        with torch.no_grad():
            params[f"{prefix}.weight"].copy_(dequantize(codes, scale, zero, args=args, dtype=torch.float32))
    return model


@pytest.mark.parametrize("quant_type", ["gptq", "awq", "weight_only_int8"])
def test_greedy_tokens_equal_the_checkpoint_dequantized_by_compressed_tensors(trained_llama, quantized, quant_type):
    out = quantized(quant_type)
    reference = _dequantized_by_compressed_tensors(trained_llama, out)
    prompts = markov_sequences(4, 12, seed=123).tolist()
    want = []
    with torch.no_grad():
        for prompt in prompts:
            ids = reference.generate(torch.tensor([prompt]), max_new_tokens=16, do_sample=False, min_new_tokens=16)
            want.append(ids[0, len(prompt):].tolist())
    assert greedy_generate(load_ours(out), prompts, 16) == want


def test_default_dtype_keeps_unquantized_parts_in_bf16(trained_llama, calib_ids, tmp_path):
    from safetensors import safe_open

    out = tmp_path / "out"
    _quantize(trained_llama, out, "fp8", calib_ids)
    with safe_open(str(out / "model.safetensors"), "pt") as f:
        assert f.get_tensor("model.embed_tokens.weight").dtype == torch.bfloat16
        assert f.get_tensor("model.layers.0.mlp.down_proj.weight").dtype == torch.float8_e4m3fn
    served = load_ours(out, "bfloat16")
    report = teacher_forced_parity(load_ours(Path(trained_llama)), served, markov_sequences(4, 48, seed=9).tolist(), 1)
    assert report.top1_agreement >= 0.95, str(report)
