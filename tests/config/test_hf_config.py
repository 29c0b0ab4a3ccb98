"""config.json -> ArchConfig: both RoPE spellings, derived context, and sliding windows as transformers
applies them (a window on only some layers is refused at start-up, naming the key)."""

from __future__ import annotations

import json

import pytest

from aserve.config import ArchConfig, ConfigError
from aserve.config.hf_config import derived_max_model_len, layer_sliding_windows, read_hf_config

BASE = {"vocab_size": 10, "hidden_size": 8, "intermediate_size": 16, "num_hidden_layers": 4,
        "num_attention_heads": 2}
QWEN2 = {**BASE, "architectures": ["Qwen2ForCausalLM"]}


def test_rope_parameters_and_legacy_fields():
    new = ArchConfig.from_hf_dict({**BASE, "rope_parameters": {"rope_type": "linear", "factor": 2.0,
                                                                "rope_theta": 5e5}})
    old = ArchConfig.from_hf_dict({**BASE, "rope_theta": 5e5, "rope_scaling": {"type": "linear", "factor": 2.0}})
    assert new.rope_theta == old.rope_theta == 5e5
    assert new.rope_scaling == {"rope_type": "linear", "factor": 2.0}
    assert old.rope_scaling["rope_type"] == "linear" and old.rope_scaling["factor"] == 2.0
    plain = ArchConfig.from_hf_dict({**BASE, "rope_parameters": {"rope_type": "default", "rope_theta": 1e4}})
    assert plain.rope_scaling is None and plain.rope_theta == 1e4
    assert ArchConfig.from_hf_dict(BASE).rope_theta == 10000.0


def test_overrides_win_and_family_defaults():
    arch = ArchConfig.from_hf_dict({**QWEN2, "eos_token_id": [3, 4]}, {"rope_theta": 123.0, "hidden_size": 16})
    assert arch.rope_theta == 123.0 and arch.hidden_size == 16 and arch.head_dim == 8
    assert arch.attention_bias and arch.eos_token_ids == (3, 4) and arch.num_key_value_heads == 2
    llama = ArchConfig.from_hf_dict({**BASE, "eos_token_id": 2})
    assert llama.architecture == "LlamaForCausalLM" and not llama.attention_bias and llama.eos_token_ids == (2,)


@pytest.mark.parametrize("scaling, want", [
    (None, 512),
    ({"rope_type": "linear", "factor": 2.0}, 1024),
    ({"rope_type": "dynamic", "factor": 4.0}, 2048),
    ({"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
      "original_max_position_embeddings": 64}, 512),
])
def test_derived_max_model_len(scaling, want):
    arch = ArchConfig.from_hf_dict({**BASE, "max_position_embeddings": 512, "rope_scaling": scaling})
    assert derived_max_model_len(arch) == want


# (config.json keys on top of a 4-layer Qwen2, the window every layer uses)
UNIFORM = [
    pytest.param({"use_sliding_window": False, "sliding_window": 16, "max_window_layers": 1}, None, id="off"),
    pytest.param({"use_sliding_window": False, "sliding_window": 16,
                  "layer_types": ["full_attention", "sliding_attention"] * 2}, None, id="off-mixed-types"),
    pytest.param({"use_sliding_window": True, "sliding_window": None, "max_window_layers": 1}, None, id="no-size"),
    pytest.param({"use_sliding_window": True, "sliding_window": 16, "max_window_layers": 0}, 16, id="all-layers"),
    pytest.param({"use_sliding_window": True, "sliding_window": 16, "max_window_layers": 4}, None, id="no-layer"),
    pytest.param({"use_sliding_window": True, "sliding_window": 16}, None, id="default-28-layers"),
    pytest.param({"use_sliding_window": True, "sliding_window": 16,
                  "layer_types": ["sliding_attention"] * 4}, 16, id="types-all-sliding"),
    pytest.param({"use_sliding_window": True, "sliding_window": 16, "max_window_layers": 2,
                  "layer_types": ["full_attention"] * 4}, None, id="types-win-over-max-window-layers"),
]
MIXED = [
    pytest.param({"use_sliding_window": True, "sliding_window": 16, "max_window_layers": 2},
                 "max_window_layers", id="max-window-layers"),
    pytest.param({"use_sliding_window": True, "sliding_window": 16, "max_window_layers": 0,
                  "layer_types": ["sliding_attention", "full_attention"] * 2}, "layer_types", id="layer-types"),
]


@pytest.mark.parametrize("keys, window", UNIFORM)
def test_qwen2_uniform_windows_are_served(keys, window):
    assert ArchConfig.from_hf_dict({**QWEN2, **keys}).layer_sliding_windows == (window,) * 4


@pytest.mark.parametrize("keys, key", MIXED)
def test_qwen2_windows_on_some_layers_are_served_per_layer(keys, key):
    windows = ArchConfig.from_hf_dict({**QWEN2, **keys}).layer_sliding_windows
    assert set(windows) == {None, 16} and len(windows) == 4
    assert ArchConfig.from_hf_dict({**QWEN2, **keys}, disable_sliding_window=True).layer_sliding_windows == ()


@pytest.mark.parametrize("family", ["Qwen2", "Qwen3"])
@pytest.mark.parametrize("keys", [p.values[0] for p in UNIFORM + MIXED])
def test_layer_windows_match_transformers(keys, family):
    """The per-layer rule is transformers' own: <Family>Config.layer_types with its sliding_window."""
    transformers = pytest.importorskip("transformers")
    cfg = getattr(transformers, f"{family}Config")(**{**QWEN2, **keys})
    want = [cfg.sliding_window if kind == "sliding_attention" else None for kind in cfg.layer_types]
    assert layer_sliding_windows({**QWEN2, **keys}, f"{family}ForCausalLM") == want


def test_layer_types_of_the_wrong_length_are_refused():
    keys = {"use_sliding_window": True, "sliding_window": 16, "layer_types": ["sliding_attention"] * 3}
    with pytest.raises(ConfigError, match="^--model: config.json's layer_types has 3 entries"):
        ArchConfig.from_hf_dict({**QWEN2, **keys})


def test_mistral_windows_every_layer_by_default_and_llama_never():
    mistral = {**BASE, "architectures": ["MistralForCausalLM"], "sliding_window": 32}
    assert ArchConfig.from_hf_dict(mistral).layer_sliding_windows == (32,) * 4
    assert ArchConfig.from_hf_dict({**mistral, "sliding_window": None}).layer_sliding_windows == (None,) * 4
    assert ArchConfig.from_hf_dict({**BASE, "sliding_window": 32}).layer_sliding_windows == (None,) * 4


def test_read_hf_config_names_the_model_flag(tmp_path):
    with pytest.raises(ConfigError, match="^--model: no config.json"):
        read_hf_config(str(tmp_path))
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(ConfigError, match="^--model: .* not valid JSON"):
        read_hf_config(str(tmp_path))
    (tmp_path / "config.json").write_text(json.dumps(BASE))
    assert read_hf_config(str(tmp_path)) == BASE
