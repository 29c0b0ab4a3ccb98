"""A model folder holding only a config.json: all that aserve/config reads."""

from __future__ import annotations

import json

import pytest

LLAMA = {"architectures": ["LlamaForCausalLM"], "vocab_size": 100, "hidden_size": 64, "intermediate_size": 128,
         "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
         "max_position_embeddings": 512, "torch_dtype": "float32", "eos_token_id": 2}


@pytest.fixture()
def write_model_dir(tmp_path):
    """`write_model_dir(**overrides)` -> a folder whose config.json is a tiny Llama's plus `overrides`."""
    def write(**overrides) -> str:
        (tmp_path / "config.json").write_text(json.dumps({**LLAMA, **overrides}))
        return str(tmp_path)

    return write


@pytest.fixture()
def model_dir(write_model_dir):
    return write_model_dir()
