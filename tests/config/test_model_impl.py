"""`--model-impl` (aserve/config/model_impl.py): which implementation serves a config, what the
Transformers backend refuses and why, and the sizes it reads from families' own config keys."""

from __future__ import annotations

import logging

import pytest

from aserve.config import ConfigError, EngineArgs
from aserve.config.model_impl import choose_model_impl, transformers_arch_config, transformers_refusal

# config.json as transformers 5 writes it for a GPT-NeoX (no num_key_value_heads, no head_dim; the
# partial rotary inside rope_parameters) and the older spelling (rotary_pct at the top level).
NEOX = {"architectures": ["GPTNeoXForCausalLM"], "model_type": "gpt_neox", "vocab_size": 512, "hidden_size": 64,
        "intermediate_size": 128, "num_hidden_layers": 3, "num_attention_heads": 4, "max_position_embeddings": 1024,
        "is_decoder": False, "eos_token_id": 2, "layer_norm_eps": 1e-5,
        "rope_parameters": {"partial_rotary_factor": 0.5, "rope_theta": 10000.0, "rope_type": "default"}}
NEOX_OLD = {**{k: v for k, v in NEOX.items() if k != "rope_parameters"}, "rotary_pct": 0.25, "rotary_emb_base": 10000}
STABLELM = {"architectures": ["StableLmForCausalLM"], "model_type": "stablelm", "vocab_size": 512, "hidden_size": 64,
            "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
            "max_position_embeddings": 4096, "partial_rotary_factor": 0.25, "eos_token_id": [0, 2]}


@pytest.mark.parametrize("cfg,expected", [
    (NEOX, dict(num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=4, head_dim=16, vocab_size=512,
                max_position_embeddings=1024, eos_token_ids=(2,))),
    (NEOX_OLD, dict(num_hidden_layers=3, num_key_value_heads=4, head_dim=16)),
    (STABLELM, dict(num_key_value_heads=2, head_dim=16, max_position_embeddings=4096, eos_token_ids=(0, 2))),
    # GPT-2's spelling, with a key aserve's own GPT-2 class refuses (transformers implements it).
    ({"architectures": ["GPT2LMHeadModel"], "vocab_size": 100, "n_embd": 32, "n_layer": 2, "n_head": 2,
      "n_positions": 256, "n_inner": None, "reorder_and_upcast_attn": True},
     dict(hidden_size=32, num_hidden_layers=2, num_key_value_heads=2, head_dim=16, max_position_embeddings=256)),
    # Falcon's multi-query attention: one KV head.
    ({"architectures": ["FalconForCausalLM"], "vocab_size": 100, "hidden_size": 64, "num_hidden_layers": 2,
      "num_attention_heads": 8, "multi_query": True}, dict(num_key_value_heads=1, head_dim=8)),
])
def test_sizes_come_from_each_familys_keys(cfg, expected):
    arch = transformers_arch_config(cfg)
    assert arch.architecture == cfg["architectures"][0]
    assert {k: getattr(arch, k) for k in expected} == expected
    assert arch.layer_sliding_windows == (None,) * arch.num_hidden_layers  # transformers passes windows


def test_missing_size_names_the_key():
    with pytest.raises(ConfigError, match=r"^--model: config.json has no num_hidden_layers \(looked for "
                                          r"num_hidden_layers, n_layer"):
        transformers_arch_config({k: v for k, v in NEOX.items() if k != "num_hidden_layers"})


@pytest.mark.parametrize("cfg,reason", [
    ({"architectures": ["T5ForConditionalGeneration"], "is_encoder_decoder": True}, "encoder-decoder"),
    ({"architectures": ["BartForConditionalGeneration"], "is_encoder_decoder": True}, "encoder-decoder"),
    ({"architectures": ["BertForMaskedLM"]}, "not a causal language model"),
    ({"architectures": ["Qwen2Model"]}, "not a causal language model"),
    ({"architectures": ["MyForCausalLM"], "is_causal": False}, "not a causal language model"),
    ({"architectures": ["LlavaForConditionalGeneration"], "vision_config": {}}, "multimodal"),
    ({"architectures": ["BloomForCausalLM"], "model_type": "bloom"}, "ALiBi"),
    ({"architectures": ["MptForCausalLM"], "attn_config": {"alibi": True}}, "ALiBi"),
    ({"architectures": ["FalconForCausalLM"], "alibi": True}, "ALiBi"),
    ({"architectures": ["MambaForCausalLM"], "state_size": 16, "time_step_rank": 4}, "recurrent / state-space"),
    ({"architectures": ["Qwen3NextForCausalLM"], "layer_types": ["linear_attention", "full_attention"]},
     r"layer_types \['linear_attention'\]"),
    ({**NEOX, "quantization_config": {"quant_method": "gptq"}}, "pre-quantized"),
])
def test_refusals_name_the_reason(cfg, reason):
    assert transformers_refusal(cfg, cfg["architectures"][0]) is not None
    with pytest.raises(ConfigError, match=rf"^--model-impl: the Transformers backend cannot serve .*{reason}"):
        choose_model_impl("transformers", cfg["architectures"][0], cfg)


@pytest.mark.parametrize("cfg", [NEOX, NEOX_OLD, STABLELM, {**NEOX, "alibi": False, "layer_types": ["full_attention"]}])
def test_decoder_only_causal_lms_are_served(cfg):
    assert transformers_refusal(cfg, cfg["architectures"][0]) is None


def test_choice_and_its_log_line(caplog):
    with caplog.at_level(logging.INFO, logger="aserve.config"):
        assert choose_model_impl("auto", "LlamaForCausalLM", {}) == "aserve"
        assert choose_model_impl("auto", "GPTNeoXForCausalLM", NEOX) == "transformers"
        assert choose_model_impl("transformers", "LlamaForCausalLM", {"architectures": ["LlamaForCausalLM"]}) \
            == "transformers"
    assert "LlamaForCausalLM runs on aserve's native implementation" in caplog.text
    assert "aserve has no native GPTNeoXForCausalLM; using the Transformers backend" in caplog.text
    with pytest.raises(ConfigError, match=r"^--model: architecture 'GPTNeoXForCausalLM' is not supported; supported: "):
        choose_model_impl("aserve", "GPTNeoXForCausalLM", NEOX)
    with pytest.raises(ConfigError, match=r"^--model: architecture 'BertForMaskedLM' is not supported; .*"
                                          r"the Transformers backend cannot serve it either: .*not a causal"):
        choose_model_impl("auto", "BertForMaskedLM", {"architectures": ["BertForMaskedLM"]})


def test_engine_args_flag_and_combinations(write_model_dir):
    with pytest.raises(ConfigError, match=r"^--model-impl: must be one of \('auto', 'aserve', 'transformers'\)"):
        EngineArgs(model_impl="vllm").validate()
    for kwargs, flag in [(dict(quantization="int8"), "--quantization"),
                         (dict(disable_sliding_window=True), "--disable-sliding-window"),
                         (dict(compilation_config=3), "--compilation-config")]:
        with pytest.raises(ConfigError, match=rf"^{flag}: .*Transformers backend"):
            EngineArgs(model_impl="transformers", **kwargs).validate()  # before any model file is read
    neox = write_model_dir(**{k: v for k, v in NEOX.items() if k != "intermediate_size"}, num_key_value_heads=None)
    with pytest.raises(ConfigError, match=r"^--quantization: .*Transformers backend"):  # chosen by auto
        EngineArgs(model=neox, quantization="int8").create_config()
    cfg = EngineArgs(model=neox).create_config(cuda_available=True)  # the CUDA default -O3 falls back to eager
    assert cfg.model.model_impl == "transformers" and cfg.runner.enforce_eager and cfg.runner.compile_sizes == ()
    assert cfg.model.arch.num_key_value_heads == 4 and cfg.model.max_model_len == 1024
    cfg = EngineArgs(model=neox, hf_overrides={"layer_norm_eps": 1e-3}, rope_theta=5e5).create_config()
    assert cfg.model.hf_overrides == {"layer_norm_eps": 1e-3, "rope_theta": 5e5}
    assert EngineArgs(model=write_model_dir()).create_config().model.model_impl == "aserve"


def test_command_line_flag():
    from aserve.server.args import parse_args

    assert parse_args([], environ={})[0].model_impl == "auto"
    assert parse_args(["--model-impl", "transformers"], environ={})[0].model_impl == "transformers"
