"""Choosing the quantization method: the checkpoint's `quantization_config` (or a quantize_config.json
beside config.json), `--quantization` / `-q` overriding it, mismatches and formats not built refused at
start-up naming them (aserve/config/quantization.py)."""

from __future__ import annotations

import json

import pytest

from aserve.config import ConfigError, EngineArgs
from aserve.config.quantization import QuantSpec

GPTQ = {"quant_method": "gptq", "bits": 4, "group_size": 128, "desc_act": True, "sym": False}
AWQ = {"quant_method": "awq", "bits": 4, "group_size": 128, "zero_point": True, "version": "gemm"}
CT_W4A16 = {"quant_method": "compressed-tensors", "format": "pack-quantized", "ignore": ["lm_head"],
            "config_groups": {"group_0": {"targets": ["Linear"], "input_activations": None, "weights": {
                "num_bits": 4, "type": "int", "symmetric": True, "strategy": "group", "group_size": 128}}}}



def _ct(fmt: str, weights: dict, acts: dict | None, **top) -> dict:
    """A compressed-tensors config as llm-compressor writes it (one group targeting Linear)."""
    return {"quant_method": "compressed-tensors", "format": fmt, "ignore": ["lm_head"], "kv_cache_scheme": None,
            "config_groups": {"group_0": {"targets": ["Linear"], "format": fmt, "weights": weights,
                                          "input_activations": acts, "output_activations": None}}, **top}


INT8_CHANNEL = {"num_bits": 8, "type": "int", "symmetric": True, "strategy": "channel", "dynamic": False,
                "actorder": "static"}
INT8_TOKEN = {"num_bits": 8, "type": "int", "symmetric": True, "strategy": "token", "dynamic": True}
INT8_STATIC = {**INT8_TOKEN, "strategy": "tensor", "dynamic": False}
FP8_CHANNEL = {"num_bits": 8, "type": "float", "symmetric": True, "strategy": "channel", "dynamic": False}
FP8_TOKEN = {"num_bits": 8, "type": "float", "symmetric": True, "strategy": "token", "dynamic": True}
CT_W8A8 = _ct("int-quantized", INT8_CHANNEL, INT8_TOKEN)
CT_FP8 = _ct("float-quantized", FP8_CHANNEL, FP8_TOKEN)
CT_W8A16 = _ct("pack-quantized", INT8_CHANNEL, None)


def _load(path: str, **kwargs):
    return EngineArgs(model=path, device="cpu", **kwargs).create_config().load


@pytest.mark.parametrize("qc, method, spec", [
    (GPTQ, "gptq", QuantSpec("gptq", 4, 128, desc_act=True, sym=False, gptq_v1_zeros=True)),
    ({**GPTQ, "checkpoint_format": "gptq_v2", "group_size": -1}, "gptq",
     QuantSpec("gptq", 4, -1, desc_act=True, sym=False, gptq_v1_zeros=False)),
    ({**GPTQ, "bits": 8}, "gptq", QuantSpec("gptq", 8, 128, desc_act=True, sym=False, gptq_v1_zeros=True)),
    (AWQ, "awq", QuantSpec("awq", 4, 128, sym=False)),
    (CT_W4A16, "compressed-tensors", QuantSpec("compressed-tensors", 4, 128, sym=True, ignore=("lm_head",))),
    ({"quant_method": "fp8", "activation_scheme": "dynamic"}, "fp8",
     QuantSpec("fp8", 8, -1, activation_scheme="dynamic")),
    ({"quant_method": "fp8", "activation_scheme": "static", "ignored_layers": ["lm_head"]}, "fp8",
     QuantSpec("fp8", 8, -1, ignore=("lm_head",), activation_scheme="static")),
    ({"quant_method": "fp8", "activation_scheme": "dynamic", "fmt": "e4m3", "weight_block_size": [128, 128]}, "fp8",
     QuantSpec("fp8", 8, 128, block_size=(128, 128), activation_scheme="dynamic")),
    (CT_W8A8, "compressed-tensors", QuantSpec("w8a8", 8, -1, ignore=("lm_head",), activation_scheme="dynamic")),
    (_ct("int-quantized", {**INT8_CHANNEL, "strategy": "tensor"}, INT8_STATIC, ignore=["re:.*lm_head"]),
     "compressed-tensors", QuantSpec("w8a8", 8, -1, ignore=("re:.*lm_head",), activation_scheme="static")),
    (CT_FP8, "compressed-tensors", QuantSpec("fp8", 8, -1, ignore=("lm_head",), activation_scheme="dynamic")),
    (_ct("float-quantized", {**FP8_CHANNEL, "strategy": "tensor"}, {**FP8_TOKEN, "strategy": "tensor",
                                                                    "dynamic": False}),
     "compressed-tensors", QuantSpec("fp8", 8, -1, ignore=("lm_head",), activation_scheme="static")),
    (_ct("float-quantized", {**FP8_CHANNEL, "strategy": "block", "block_structure": [128, 64]},
         {**FP8_TOKEN, "strategy": "group", "group_size": 128}),
     "compressed-tensors", QuantSpec("fp8", 8, 64, ignore=("lm_head",), block_size=(128, 64),
                                     activation_scheme="dynamic")),
    (CT_W8A16, "compressed-tensors", QuantSpec("compressed-tensors", 8, -1, ignore=("lm_head",))),
])
def test_the_checkpoint_selects_the_method(write_model_dir, qc, method, spec):
    load = _load(write_model_dir(quantization_config=qc))
    assert (load.quantization, load.quant_spec) == (method, spec)


def test_a_quantize_config_json_beside_config_json_is_gptq(model_dir):
    with open(f"{model_dir}/quantize_config.json", "w") as f:
        json.dump({"bits": 4, "group_size": 64, "desc_act": False}, f)
    load = _load(model_dir)
    assert load.quantization == "gptq" and load.quant_spec.group_size == 64


@pytest.mark.parametrize("flag", ["gptq", "gptq_marlin"])
def test_a_matching_flag_is_accepted(write_model_dir, flag):
    assert _load(write_model_dir(quantization_config=GPTQ), quantization=flag).quantization == "gptq"


def test_online_fp8_of_a_float_checkpoint(model_dir):
    load = _load(model_dir, quantization="fp8")
    assert (load.quantization, load.quant_spec) == ("fp8", None)


def test_a_matching_fp8_flag_is_accepted_on_an_fp8_checkpoint(write_model_dir):
    load = _load(write_model_dir(quantization_config={"quant_method": "fp8"}), quantization="fp8")
    assert load.quantization == "fp8" and load.quant_spec.method == "fp8"


def test_weight_only_int8_is_int8(model_dir):
    assert _load(model_dir, quantization="weight_only_int8").quantization == "int8"


def test_short_flag():
    from aserve.server.args import make_parser

    assert make_parser().parse_args(["-q", "awq"]).quantization == "awq"


@pytest.mark.parametrize("qc, flag, named", [
    (AWQ, "gptq", ["'gptq'", "'awq'"]),  # flag vs checkpoint: both named
    (GPTQ, "int4", ["'int4'", "'gptq'"]),
    (None, "gptq", ["'gptq'", "no quantization_config"]),  # a float checkpoint
    (GPTQ, "fp8", ["'fp8'", "'gptq'"]),  # online fp8 of an already-quantized checkpoint
    ({"quant_method": "fp8"}, "int8", ["'int8'", "'fp8'"]),
])
def test_a_mismatch_names_both(write_model_dir, qc, flag, named):
    path = write_model_dir(**({"quantization_config": qc} if qc else {}))
    with pytest.raises(ConfigError, match="^--quantization") as info:
        _load(path, quantization=flag)
    assert all(n in str(info.value) for n in named)


@pytest.mark.parametrize("qc, named", [
    ({"quant_method": "fbgemm_fp8"}, "'fbgemm_fp8'"),
    ({"quant_method": "fp8", "fmt": "e5m2"}, "'e5m2'"),
    ({"quant_method": "fp8", "activation_scheme": "per-token"}, "'per-token'"),
    ({"quant_method": "fp8", "weight_block_size": [128]}, "weight_block_size"),
    ({"quant_method": "bitsandbytes", "load_in_4bit": True, "bnb_4bit_quant_storage": "bfloat16"},
     "bnb_4bit_quant_storage 'bfloat16'"),
    ({"quant_method": "bitsandbytes", "load_in_4bit": False}, "neither load_in_4bit nor load_in_8bit"),
    ({"quant_method": "bitsandbytes", "load_in_4bit": True, "bnb_4bit_quant_type": "int4"}, "'int4'"),
    ({"quant_method": "bitsandbytes", "load_in_8bit": True, "llm_int8_has_fp16_weight": True},
     "llm_int8_has_fp16_weight"),
    ({**GPTQ, "bits": 3}, "bits 3"),
    ({**GPTQ, "bits": 2}, "bits 2"),
    ({**GPTQ, "checkpoint_format": "marlin"}, "'marlin'"),
    ({**AWQ, "version": "gemv"}, "'gemv'"),
    ({**AWQ, "version": "exllama"}, "'exllama'"),
    ({**AWQ, "zero_point": False}, "zero_point"),
    ({**CT_W4A16, "format": "naive-quantized"}, "'naive-quantized'"),
    ({**CT_W4A16, "format": "int-quantized"}, "int-quantized int 4-bit"),
    ({**CT_W4A16, "format": "float-quantized"}, "float-quantized int 4-bit"),
    (_ct("int-quantized", INT8_CHANNEL, {**INT8_TOKEN, "symmetric": False}), "asymmetric input_activations"),
    (_ct("int-quantized", {**INT8_CHANNEL, "symmetric": False}, INT8_TOKEN), "asymmetric int-quantized weights"),
    (_ct("int-quantized", {**INT8_CHANNEL, "strategy": "group", "group_size": 128}, INT8_TOKEN), "strategy 'group'"),
    (_ct("int-quantized", {**INT8_CHANNEL, "strategy": "block"}, INT8_TOKEN), "strategy 'block'"),
    (_ct("int-quantized", INT8_CHANNEL, {**INT8_TOKEN, "strategy": "tensor"}),
     "dynamic input_activations with strategy 'tensor'"),
    (_ct("int-quantized", INT8_CHANNEL, {**INT8_TOKEN, "strategy": "group"}), "strategy 'group'"),
    (_ct("int-quantized", INT8_CHANNEL, None), "without input_activations"),
    (_ct("int-quantized", INT8_CHANNEL, FP8_TOKEN), "float 8-bit input_activations"),
    (_ct("float-quantized", {**FP8_CHANNEL, "strategy": "group", "group_size": 32}, FP8_TOKEN),
     "float-quantized weight strategy 'group'"),
    (_ct("float-quantized", {**FP8_CHANNEL, "num_bits": 4}, FP8_TOKEN), "float 4-bit"),
    (_ct("float-quantized", {**FP8_CHANNEL, "strategy": "block", "block_structure": None}, FP8_TOKEN),
     "block_structure"),
    ({**CT_W8A8, "config_groups": {"a": CT_W8A8["config_groups"]["group_0"],
                                   "b": CT_W8A16["config_groups"]["group_0"]}}, "2 config_groups"),
    ({**CT_W8A8, "config_groups": {"g": {**CT_W8A8["config_groups"]["group_0"], "output_activations": INT8_TOKEN}}},
     "output_activations"),
    ({**CT_W8A8, "kv_cache_scheme": {"num_bits": 8, "type": "int", "strategy": "tensor"}}, "kv_cache_scheme int 8-bit"),
    ({**CT_W8A8, "kv_cache_scheme": {"num_bits": 8, "type": "float", "strategy": "channel"}}, "strategy 'channel'"),
    ({**CT_W8A8, "ignore": ["re:model.layers.(0"]}, "'re:model.layers.(0'"),
    ({**CT_W4A16, "config_groups": {"g": {**CT_W4A16["config_groups"]["group_0"],
                                          "input_activations": {"num_bits": 8}}}}, "activation"),
    ({"quant_method": "mystery"}, "'mystery'"),
])
def test_formats_not_built_are_refused_naming_them(write_model_dir, qc, named):
    with pytest.raises(ConfigError, match="quantization_config") as info:
        _load(write_model_dir(quantization_config=qc))
    assert named in str(info.value)


@pytest.mark.parametrize("kwargs", [dict(quantization="fbgemm_fp8"), dict(quantization="bitsandbytes", device="cuda"),
                                    dict(quantization="gptq", device="cuda")])  # a float checkpoint
def test_flags_not_built_are_refused(model_dir, kwargs):
    with pytest.raises(ConfigError, match="^--quantization"):
        EngineArgs(model=model_dir, **{"device": "cpu", **kwargs}).create_config(cuda_available=True)


@pytest.mark.parametrize("flag, named", [("int4", "'int4'"), ("gguf", "'gguf'"), ("bitsandbytes", "'bitsandbytes'"),
                                         ("int8", "'int8'"), ("weight_only_int8", "'int8'")])
def test_cpu_only_methods_are_refused_on_cuda_naming_them(model_dir, flag, named):
    """int4 / gguf / bitsandbytes before any model work; int8 once the checkpoint shows it is a float one."""
    with pytest.raises(ConfigError, match="^--quantization: .*CPU only") as info:
        EngineArgs(model=model_dir, device="cuda", quantization=flag).create_config(cuda_available=True)
    assert named in str(info.value)


@pytest.mark.parametrize("qc, flag, method", [
    (GPTQ, None, "gptq"), (AWQ, None, "awq"), (CT_W4A16, None, "compressed-tensors"),
    (CT_W8A8, None, "compressed-tensors"), (CT_FP8, None, "compressed-tensors"), (CT_W8A16, "int8", "compressed-tensors"),
    ({"quant_method": "fp8", "activation_scheme": "dynamic", "weight_block_size": [128, 128]}, None, "fp8"),
    (None, "fp8", "fp8"),  # online fp8 of a float checkpoint
])
def test_methods_with_a_cuda_path_are_accepted_on_cuda(write_model_dir, qc, flag, method):
    path = write_model_dir(**({} if qc is None else {"quantization_config": qc}))
    cfg = EngineArgs(model=path, device="cuda", quantization=flag).create_config(cuda_available=True)
    assert cfg.load.quantization == method and cfg.device.device == "cuda"


def test_quantized_checkpoints_with_tensor_parallelism_are_refused(write_model_dir):
    with pytest.raises(ConfigError, match="^--quantization.*tensor-parallel"):
        _load(write_model_dir(quantization_config=GPTQ), tensor_parallel_size=2)


@pytest.mark.parametrize("qc, flag, method", [
    (CT_W8A8, "smooth_quant", "w8a8"),  # seed 004's name of a W8A8 checkpoint
    (_ct("int-quantized", INT8_CHANNEL, INT8_STATIC), "smooth_quant", "w8a8"),
    (CT_W8A8, "compressed-tensors", "w8a8"),
    (CT_W8A16, "weight_only_int8", "compressed-tensors"),  # seed 004's int8 name, an 8-bit weight-only checkpoint
    (CT_W8A16, "int8", "compressed-tensors"),
    (CT_FP8, "fp8", "fp8"),
])
def test_scheme_names_of_compressed_tensors_checkpoints_are_accepted(write_model_dir, qc, flag, method):
    load = _load(write_model_dir(quantization_config=qc), quantization=flag)
    assert (load.quantization, load.quant_spec.method) == ("compressed-tensors", method)


@pytest.mark.parametrize("qc, flag, named", [
    (GPTQ, "smooth_quant", ["'smooth_quant'", "'gptq'", "aserve quantize"]),
    (CT_W4A16, "smooth_quant", ["'smooth_quant'", "'compressed-tensors'", "'pack-quantized'"]),
    (CT_FP8, "smooth_quant", ["'smooth_quant'", "'compressed-tensors'", "'float-quantized'"]),
    (CT_W4A16, "weight_only_int8", ["'weight_only_int8'", "'compressed-tensors'"]),  # 4-bit weights
    (CT_W8A8, "weight_only_int8", ["'weight_only_int8'", "'int-quantized'"]),
    (CT_W8A8, "fp8", ["'fp8'", "'int-quantized'"]),
    (CT_W8A8, "gptq", ["'gptq'", "'compressed-tensors'"]),
])
def test_scheme_names_of_other_checkpoints_are_mismatches(write_model_dir, qc, flag, named):
    with pytest.raises(ConfigError, match="^--quantization") as info:
        _load(write_model_dir(quantization_config=qc), quantization=flag)
    assert all(n in str(info.value) for n in named), str(info.value)


def test_smooth_quant_on_a_float_checkpoint_points_to_aserve_quantize(model_dir):
    with pytest.raises(ConfigError, match="^--quantization") as info:
        _load(model_dir, quantization="smooth_quant")
    message = str(info.value)
    assert "W8A8 checkpoint" in message and "aserve quantize -i MODEL -o OUT --quant-type smooth_quant" in message


@pytest.mark.parametrize("module, ignored", [
    ("lm_head", True), ("model.lm_head", False),  # plain entries name a module exactly
    ("model.layers.0.mlp.down_proj", True), ("model.layers.10.mlp.down_proj", False),
    ("model.layers.3.self_attn.q_proj", True), ("model.layers.3.self_attn.o_proj", False),
])
def test_ignore_entries_are_names_or_regexes(module, ignored):
    spec = QuantSpec("w8a8", 8, -1, ignore=("lm_head", r"re:model\.layers\.0\.", "re:.*q_proj"))
    assert spec.ignores(module) is ignored


def _bnb_installed(monkeypatch, installed: bool) -> None:
    """Whether the config layer finds the bitsandbytes package (it only looks it up, never imports it)."""
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a, **k: (object() if installed else None)
                        if name == "bitsandbytes" else real(name, *a, **k))


BNB_4BIT = {"quant_method": "bitsandbytes", "load_in_4bit": True, "load_in_8bit": False, "bnb_4bit_quant_type": "nf4",
            "bnb_4bit_use_double_quant": True, "bnb_4bit_compute_dtype": "bfloat16", "bnb_4bit_quant_storage": "uint8",
            "llm_int8_skip_modules": None, "llm_int8_threshold": 6.0}


@pytest.mark.parametrize("qc, spec", [
    (BNB_4BIT, QuantSpec("bitsandbytes", 4, 64, quant_type="nf4")),
    ({**BNB_4BIT, "bnb_4bit_quant_type": "fp4", "bnb_4bit_use_double_quant": False}, QuantSpec(
        "bitsandbytes", 4, 64, quant_type="fp4")),
    ({"quant_method": "bitsandbytes", "load_in_8bit": True, "llm_int8_skip_modules": ["lm_head"]},
     QuantSpec("bitsandbytes", 8, -1, ignore=("lm_head",))),
])
def test_bitsandbytes_checkpoints_are_read(write_model_dir, monkeypatch, qc, spec):
    _bnb_installed(monkeypatch, True)
    for flag in (None, "bitsandbytes"):
        load = _load(write_model_dir(quantization_config=qc), quantization=flag)
        assert (load.quantization, load.quant_spec) == ("bitsandbytes", spec)
    load = _load(write_model_dir(quantization_config=qc), load_format="bitsandbytes")  # vLLM's older spelling
    assert (load.quantization, load.quant_spec, load.load_format) == ("bitsandbytes", spec, "auto")


def test_bitsandbytes_in_flight_on_a_float_checkpoint(model_dir, monkeypatch):
    _bnb_installed(monkeypatch, True)
    for kwargs in (dict(quantization="bitsandbytes"), dict(load_format="bitsandbytes")):
        load = _load(model_dir, **kwargs)
        assert (load.quantization, load.quant_spec, load.load_format) == ("bitsandbytes", None, "auto")


@pytest.mark.parametrize("qc, kwargs", [(None, dict(quantization="bitsandbytes")), (BNB_4BIT, {}),
                                        (None, dict(load_format="bitsandbytes"))])
def test_bitsandbytes_without_the_package_names_pip_install(write_model_dir, monkeypatch, qc, kwargs):
    _bnb_installed(monkeypatch, False)
    with pytest.raises(ConfigError, match="^--quantization.*pip install bitsandbytes"):
        _load(write_model_dir(**({"quantization_config": qc} if qc else {})), **kwargs)


@pytest.mark.parametrize("kwargs, flag", [
    (dict(quantization="gptq", load_format="bitsandbytes"), "--load-format"),
    (dict(quantization="bitsandbytes", device="cuda"), "--quantization"),
    (dict(load_format="bitsandbytes", device="cuda"), "--quantization"),
])
def test_bitsandbytes_flag_combinations_refused(model_dir, kwargs, flag):
    with pytest.raises(ConfigError, match=f"^{flag}"):
        EngineArgs(model=model_dir, **{"device": "cpu", **kwargs}).create_config()


def test_a_bitsandbytes_checkpoint_with_another_flag_names_both(write_model_dir, monkeypatch):
    _bnb_installed(monkeypatch, True)
    with pytest.raises(ConfigError, match="^--quantization") as info:
        _load(write_model_dir(quantization_config=BNB_4BIT), quantization="int4")
    assert "'int4'" in str(info.value) and "'bitsandbytes'" in str(info.value)


def test_load_format_bitsandbytes_on_another_format_names_the_load_format(write_model_dir, monkeypatch):
    _bnb_installed(monkeypatch, True)
    gptq = {"quant_method": "gptq", "bits": 4, "group_size": 32, "desc_act": False, "sym": True}
    with pytest.raises(ConfigError, match="^--load-format: 'bitsandbytes' quantizes a float checkpoint.*'gptq'"):
        _load(write_model_dir(quantization_config=gptq), load_format="bitsandbytes")
