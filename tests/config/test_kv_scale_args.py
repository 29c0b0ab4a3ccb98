"""--quantization-param-path and --calculate-kv-scales at start-up (aserve/config/kv_scales.py), and a
compressed-tensors checkpoint's kv_cache_scheme (aserve/config/quantization.py)."""

from __future__ import annotations

import json

import pytest

from aserve.config import ConfigError, EngineArgs
from aserve.server.args import parse_args

FLAG = "--quantization-param-path"


def _file(tmp_path, scaling_factor=None, dtype="float8_e4m3fn", model_type="llama", name="scales.json") -> str:
    if scaling_factor is None:
        scaling_factor = {"0": {"0": 0.5, "1": 0.75}}
    path = tmp_path / name
    path.write_text(json.dumps({"model_type": model_type, "kv_cache": {"dtype": dtype,
                                                                       "scaling_factor": scaling_factor}}))
    return str(path)


def _cache(model_dir, **kwargs):
    return EngineArgs(model=model_dir, device="cpu", **kwargs).create_config().cache


def test_scales_file_is_read_per_rank_and_layer(write_model_dir, tmp_path):
    """vLLM's JSON: tp rank -> layer -> one scale for K and V (the tiny config has 2 layers)."""
    model_dir = write_model_dir(model_type="llama")
    first = _file(tmp_path)
    cache = _cache(model_dir, kv_cache_dtype="fp8", quantization_param_path=first)
    assert cache.kv_scales == ((0.5, 0.75),) and not cache.calculate_kv_scales
    two_ranks = _file(tmp_path, {"0": {"0": 0.5, "1": 1}, "1": {"1": 2.0, "0": 0.25}}, name="tp2.json")
    cache = _cache(model_dir, kv_cache_dtype="fp8_e4m3", quantization_param_path=two_ranks, tensor_parallel_size=2)
    assert cache.kv_scales == ((0.5, 1.0), (0.25, 2.0))
    e5m2 = _file(tmp_path, dtype="float8_e5m2", name="e5m2.json")
    assert _cache(model_dir, kv_cache_dtype="fp8_e5m2", quantization_param_path=e5m2).kv_scales == ((0.5, 0.75),)
    engine, _ = parse_args(["--kv-cache-dtype", "fp8", FLAG, first, "--model", model_dir])
    assert engine.quantization_param_path == first


@pytest.mark.parametrize("kwargs, message", [
    ({"scaling_factor": {"0": {"0": 0.5}}}, "rank 0 lacks the scales of layers [1]"),
    ({"scaling_factor": {"0": {"0": 0.5, "1": 0.5, "2": 0.5}}}, "layers [2] the model does not have"),
    ({"scaling_factor": {"0": {"0": 0.5, "1": 0.0}}}, "rank 0, layer 1 is 0.0; scales must be finite numbers > 0"),
    ({"scaling_factor": {"0": {"0": -1, "1": 0.5}}}, "scales must be finite numbers > 0"),
    ({"scaling_factor": {"0": {"0": "x", "1": 0.5}}}, "scales must be finite numbers > 0"),
    ({"scaling_factor": {"1": {"0": 0.5, "1": 0.5}}}, "ranks [1]; --tensor-parallel-size 1 needs ranks [0]"),
    ({"scaling_factor": {"0": {"a": 0.5}}}, "layer index 'a' is not an integer"),
    ({"scaling_factor": {}}, "scaling_factor must be an object"),
    ({"dtype": "float8_e5m2"}, "KV dtype 'float8_e5m2', but --kv-cache-dtype fp8 stores 'float8_e4m3fn'"),
    ({"model_type": "qwen2"}, "model_type 'qwen2', but the model is 'llama'"),
])
def test_scales_file_errors_name_the_flag(write_model_dir, tmp_path, kwargs, message):
    path = _file(tmp_path, **kwargs)
    with pytest.raises(ConfigError, match=f"^{FLAG}") as err:
        _cache(write_model_dir(model_type="llama"), kv_cache_dtype="fp8", quantization_param_path=path)
    assert message in str(err.value)


def test_unreadable_or_malformed_files_and_flags_without_an_fp8_cache_are_refused(model_dir, tmp_path):
    with pytest.raises(ConfigError, match=f"^{FLAG}: cannot read"):
        EngineArgs(model=model_dir, kv_cache_dtype="fp8", quantization_param_path=str(tmp_path / "none.json")).validate()
    (tmp_path / "bad.json").write_text("{not json")
    with pytest.raises(ConfigError, match=f"^{FLAG}: .*not valid JSON"):
        EngineArgs(model=model_dir, kv_cache_dtype="fp8", quantization_param_path=str(tmp_path / "bad.json")).validate()
    (tmp_path / "other.json").write_text('{"scales": [1]}')
    with pytest.raises(ConfigError, match=f'^{FLAG}: .*no "kv_cache" object'):
        EngineArgs(model=model_dir, kv_cache_dtype="fp8", quantization_param_path=str(tmp_path / "other.json")).validate()
    good = _file(tmp_path)
    with pytest.raises(ConfigError, match=f"^{FLAG}: holds fp8 KV-cache scales: it needs --kv-cache-dtype fp8"):
        EngineArgs(model=model_dir, quantization_param_path=good).validate()
    with pytest.raises(ConfigError, match="^--calculate-kv-scales: .*needs --kv-cache-dtype fp8"):
        EngineArgs(model=model_dir, calculate_kv_scales=True).validate()
    with pytest.raises(ConfigError, match=f"^{FLAG}: and --calculate-kv-scales both set"):
        EngineArgs(model=model_dir, kv_cache_dtype="fp8", calculate_kv_scales=True,
                   quantization_param_path=good).validate()
    with pytest.raises(SystemExit):  # the CLI reports it the same way
        engine, _ = parse_args(["--calculate-kv-scales"])
        try:
            engine.validate()
        except ConfigError as exc:
            assert "--calculate-kv-scales" in str(exc)
            raise SystemExit(2) from exc


def test_calculate_kv_scales_is_set_in_the_cache_config(model_dir):
    engine, _ = parse_args(["--kv-cache-dtype", "fp8_e5m2", "--calculate-kv-scales", "--model", model_dir])
    assert engine.calculate_kv_scales
    cache = engine.create_config().cache
    assert cache.calculate_kv_scales and cache.kv_scales is None


def test_compressed_tensors_kv_cache_scheme_is_accepted(write_model_dir):
    """llm-compressor's fp8 KV-cache scheme (float 8-bit, strategy tensor): the checkpoint's k_scale / v_scale
    tensors, used with an fp8 KV cache (tests/model/test_kv_scales_loading.py loads them)."""
    scheme = {"num_bits": 8, "type": "float", "symmetric": True, "strategy": "tensor", "dynamic": False}
    qc = {"quant_method": "compressed-tensors", "format": "float-quantized", "ignore": ["lm_head"],
          "kv_cache_scheme": scheme,
          "config_groups": {"group_0": {"targets": ["Linear"], "format": "float-quantized", "weights": {
              "num_bits": 8, "type": "float", "symmetric": True, "strategy": "channel", "dynamic": False},
              "input_activations": {"num_bits": 8, "type": "float", "symmetric": True, "strategy": "token",
                                    "dynamic": True}}}}
    load = EngineArgs(model=write_model_dir(quantization_config=qc), device="cpu", kv_cache_dtype="fp8").create_config().load
    assert load.quant_spec is not None and load.quant_spec.method == "fp8"
