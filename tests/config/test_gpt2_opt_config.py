"""GPT-2's and OPT's config.json read into ArchConfig as transformers reads them (their own key
spellings, derived MLP width and heads, tied heads by default), and the options aserve does not
implement refused at start-up, naming the key."""

from __future__ import annotations

import json

import pytest

from aserve.config import ArchConfig, ConfigError, EngineArgs
from aserve.config.families import GPT2Fields, OPTFields

# As the original openai-community/gpt2 config.json spells it (no tie_word_embeddings, n_inner null).
GPT2 = {"architectures": ["GPT2LMHeadModel"], "vocab_size": 50257, "n_embd": 768, "n_layer": 12, "n_head": 12,
        "n_positions": 1024, "n_ctx": 1024, "n_inner": None, "activation_function": "gelu_new",
        "layer_norm_epsilon": 1e-5, "bos_token_id": 50256, "eos_token_id": 50256}
# As facebook/opt-350m's.
OPT_350M = {"architectures": ["OPTForCausalLM"], "vocab_size": 50272, "hidden_size": 1024, "num_hidden_layers": 24,
            "num_attention_heads": 16, "ffn_dim": 4096, "max_position_embeddings": 2048,
            "word_embed_proj_dim": 512, "do_layer_norm_before": False, "activation_function": "relu",
            "bos_token_id": 2, "eos_token_id": 2, "pad_token_id": 1}


def test_gpt2_keys_and_derived_fields():
    arch = ArchConfig.from_hf_dict(GPT2)
    assert (arch.hidden_size, arch.num_hidden_layers, arch.num_attention_heads) == (768, 12, 12)
    assert arch.intermediate_size == 4 * 768 and arch.max_position_embeddings == 1024
    assert arch.num_key_value_heads == 12 and arch.head_dim == 64
    assert arch.tie_word_embeddings and arch.eos_token_ids == (50256,)
    assert arch.family == GPT2Fields(layer_norm_epsilon=1e-5, activation_function="gelu_new",
                                     scale_attn_weights=True, scale_attn_by_inverse_layer_idx=False)


def test_gpt2_reads_n_inner_and_ignores_keys_its_model_does_not_read():
    """transformers' GPT-2 never reads intermediate_size, num_key_value_heads or head_dim."""
    arch = ArchConfig.from_hf_dict({**GPT2, "n_inner": 1000, "intermediate_size": 96, "num_key_value_heads": 2,
                                    "head_dim": 32, "tie_word_embeddings": False})
    assert arch.intermediate_size == 1000 and arch.num_key_value_heads == 12 and arch.head_dim == 64
    assert not arch.tie_word_embeddings


def test_opt_keys_and_fields():
    arch = ArchConfig.from_hf_dict(OPT_350M)
    assert arch.intermediate_size == 4096 and arch.num_key_value_heads == 16 and arch.head_dim == 64
    assert arch.tie_word_embeddings and arch.max_position_embeddings == 2048
    assert arch.family == OPTFields(word_embed_proj_dim=512, do_layer_norm_before=False, enable_bias=True,
                                    layer_norm_elementwise_affine=True, activation_function="relu")
    plain = ArchConfig.from_hf_dict({**OPT_350M, "word_embed_proj_dim": None, "do_layer_norm_before": True})
    assert plain.family.word_embed_proj_dim == 1024 and plain.family.do_layer_norm_before


@pytest.mark.parametrize(("base", "key", "value"), [
    (GPT2, "reorder_and_upcast_attn", True),
    (GPT2, "add_cross_attention", True),
    (GPT2, "activation_function", "swish"),
    (OPT_350M, "_remove_final_layer_norm", True),
    (OPT_350M, "activation_function", "silu"),
])
def test_unimplemented_options_are_refused_naming_the_key(base, key, value):
    with pytest.raises(ConfigError, match=f"config.json's {key}="):
        ArchConfig.from_hf_dict({**base, key: value})


def test_engine_config_takes_the_context_from_n_positions(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({**GPT2, "n_positions": 256}))
    cfg = EngineArgs(model=str(tmp_path)).create_config()
    assert cfg.model.max_model_len == 256 and cfg.model.arch.architecture == "GPT2LMHeadModel"
