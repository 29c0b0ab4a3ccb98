"""vLLM's loading flags (issue 25): --override-generation-config, --hf-config-path, --config-format,
--ignore-patterns, --code-revision, --kv-cache-memory-bytes (its block count: tests/runner)."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import save_file

from aserve.config import ConfigError, EngineArgs
from aserve.engine.builder import generation_defaults
from aserve.model.loader import WeightsNotFoundError, weight_files
from aserve.server.args import parse_args
from tests.config.conftest import LLAMA


def test_override_generation_config_applies_over_generation_config_json(model_dir, tmp_path):
    model_gen = {"temperature": 0.6, "top_p": 0.9, "max_new_tokens": 64}
    args = EngineArgs(model=model_dir, override_generation_config={"temperature": 0.2, "top_k": 5,
                                                                   "max_new_tokens": 10})
    assert generation_defaults(args.create_config(), model_gen) == {
        "temperature": 0.2, "top_p": 0.9, "top_k": 5, "max_tokens": 10}
    # as vLLM: the overrides apply with --generation-config vllm too (no file defaults), and null drops one
    vllm = EngineArgs(model=model_dir, generation_config="vllm", override_generation_config={"min_p": 0.1})
    assert generation_defaults(vllm.create_config(), model_gen) == {"min_p": 0.1}
    dropped = EngineArgs(model=model_dir, override_generation_config={"top_p": None})
    assert generation_defaults(dropped.create_config(), model_gen) == {"temperature": 0.6, "max_tokens": 64}
    assert generation_defaults(EngineArgs(model=model_dir).create_config(), model_gen) == {
        "temperature": 0.6, "top_p": 0.9, "max_tokens": 64}
    engine, _ = parse_args(["--override-generation-config", '{"temperature": 0.5}'])
    assert engine.override_generation_config == {"temperature": 0.5}


def test_override_generation_config_refuses_unknown_keys_and_bad_values():
    with pytest.raises(ConfigError, match=r"--override-generation-config: unknown key\(s\) \['max_tokens'\]"):
        EngineArgs(override_generation_config={"max_tokens": 3}).validate()
    from aserve.engine.builder import check_sampling_overrides  # values are the engine's to check

    with pytest.raises(ConfigError, match="--override-generation-config: .*temperature"):
        check_sampling_overrides(EngineArgs(override_generation_config={"temperature": -1}))


def test_hf_config_path_replaces_the_model_folders_config_json(model_dir, tmp_path):
    other = tmp_path / "cfg"
    other.mkdir()
    (other / "config.json").write_text(json.dumps({**LLAMA, "num_hidden_layers": 3}))
    assert EngineArgs(model=model_dir).create_config().model.arch.num_hidden_layers == 2
    config = EngineArgs(model=model_dir, hf_config_path=str(other)).create_config()
    assert config.model.arch.num_hidden_layers == 3 and config.model.hf_config_path == str(other)
    assert config.model.model_path == model_dir  # weights and tokenizer still come from the model folder
    engine, _ = parse_args(["--hf-config-path", str(other)])
    assert engine.hf_config_path == str(other)
    with pytest.raises(ConfigError, match="--hf-config-path: no config.json"):
        EngineArgs(model=model_dir, hf_config_path=str(tmp_path / "missing")).validate()


def test_config_format_auto_and_hf_read_config_json_others_are_refused(model_dir):
    for fmt in ("auto", "hf"):
        assert EngineArgs(model=model_dir, config_format=fmt).create_config().model.arch.num_hidden_layers == 2
    with pytest.raises(ConfigError, match="--config-format: .*'mistral' params.json format is not implemented"
                                          ".*got 'mistral'"):
        EngineArgs(model=model_dir, config_format="mistral").validate()
    engine, _ = parse_args(["--config-format", "mistral"])
    with pytest.raises(ConfigError, match="--config-format"):
        engine.validate()  # at start-up, before any model work


def _tensor_file(path, name: str) -> None:
    save_file({name: torch.zeros(2)}, str(path))


def test_ignore_patterns_skip_matching_weight_files(tmp_path, model_dir):
    _tensor_file(tmp_path / "model.safetensors", "a")
    _tensor_file(tmp_path / "consolidated.safetensors", "b")
    both = [str(tmp_path / "consolidated.safetensors"), str(tmp_path / "model.safetensors")]
    assert weight_files(str(tmp_path), "auto") == ("safetensors", both)
    assert weight_files(str(tmp_path), "auto", ("original/**/*",)) == ("safetensors", both)  # vLLM's default
    assert weight_files(str(tmp_path), "auto", ("consolidated*",)) == ("safetensors", both[1:])
    with pytest.raises(WeightsNotFoundError, match="--ignore-patterns"):
        weight_files(str(tmp_path), "auto", ("*.safetensors",))
    # the flag reaches the loader's config (one string or several), default as vLLM's
    assert EngineArgs(model=model_dir).create_config().load.ignore_patterns == ("original/**/*",)
    engine, _ = parse_args(["--model", model_dir, "--ignore-patterns", "consolidated*", "original/**/*"])
    assert engine.create_config().load.ignore_patterns == ("consolidated*", "original/**/*")
    assert EngineArgs(model=model_dir, ignore_patterns="x*").create_config().load.ignore_patterns == ("x*",)


def test_code_revision_is_accepted_without_remote_code_and_refused_with_it(model_dir):
    """vLLM reads --code-revision only when it runs a model's remote code; aserve runs none. Without
    --trust-remote-code vLLM ignores it too (accepted, no effect); with it the code revision would be
    silently ignored here, so it is refused at start-up."""
    config = EngineArgs(model=model_dir, code_revision="abc123").create_config()
    assert config.model.model_path == model_dir
    parse_args(["--code-revision", "abc123"])
    with pytest.raises(ConfigError, match="--code-revision: 'abc123' with --trust-remote-code"):
        EngineArgs(model=model_dir, code_revision="abc123", trust_remote_code=True).validate()
    with pytest.raises(SystemExit):
        engine, _ = parse_args(["--code-revision", "abc123", "--trust-remote-code"])
        try:
            engine.validate()
        except ConfigError as exc:
            raise SystemExit(2) from exc


def test_kv_cache_memory_bytes_reaches_the_cache_config(model_dir):
    assert EngineArgs(model=model_dir).create_config().cache.kv_cache_memory_bytes is None
    engine, _ = parse_args(["--model", model_dir, "--kv-cache-memory-bytes", "1048576"])
    assert engine.create_config().cache.kv_cache_memory_bytes == 1 << 20
    with pytest.raises(ConfigError, match="--kv-cache-memory-bytes: must be >= 1"):
        EngineArgs(kv_cache_memory_bytes=0).validate()
