"""build_engine: arguments are validated before any model work; generation_config.json is read once."""

from __future__ import annotations

import json

import pytest

from aserve.config import ConfigError, EngineArgs
from aserve.engine import builder


def test_a_bad_flag_is_reported_before_the_model_is_resolved(monkeypatch):
    def resolve_model(*args, **kwargs):  # pragma: no cover - must not be reached
        raise AssertionError("the model was resolved before the arguments were validated")

    monkeypatch.setattr("aserve.model_source.resolve_model", resolve_model)
    with pytest.raises(ConfigError, match="--block-size"):
        builder.build_engine(EngineArgs(model="org/not-downloaded", block_size=7))


def test_generation_defaults_and_eos_come_from_one_read(tmp_path, tiny_llama):
    (tmp_path / "generation_config.json").write_text(json.dumps(
        {"temperature": 0.3, "top_p": 0.9, "max_new_tokens": 7, "eos_token_id": [2, 9], "do_sample": True}))
    config = EngineArgs(model=tiny_llama, skip_tokenizer_init=True).create_config(model_path=tiny_llama)
    gen = builder.read_generation_config(tmp_path)
    assert builder.generation_defaults(config, gen) == {"temperature": 0.3, "top_p": 0.9, "max_tokens": 7}
    assert builder.eos_token_ids(config, gen, None) == (2, 9)
    assert builder.read_generation_config(tmp_path / "missing") == {}
