"""The Transformers backend (`--model-impl transformers`): transformers' modeling code with aserve's
paged attention gives Hugging Face's greedy tokens through `LLM.generate` for families aserve has no
class for (GPT-NeoX, StableLM: tiny fp32 checkpoints built here), under chunked prefill, prefix
caching and preemption in one mixed batch; on families aserve does implement it matches the native
class, honouring per-layer windows and soft-capping as transformers passes them. `--model-impl`
auto picks it (and logs so) where there is no native class, `aserve` refuses such an architecture by
name, and models it cannot serve faithfully fail at start-up with the reason."""

from __future__ import annotations

import json
import logging

import pytest

from aserve import LLM
from aserve.config import ConfigError
from tests.e2e.test_hf_equivalence import CASES, PROMPTS, _generate, _llm
from tests.support.tiny_models import GREEDY_STABLE, hf_greedy, save_tiny_hf

MAX_NEW = 12
_SIZES = {"vocab_size": 512, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
          "num_attention_heads": 4, "max_position_embeddings": 1024, "initializer_range": 0.15,
          "bos_token_id": 1, "eos_token_id": 2}
# transformers' own config classes, as a user's checkpoint would have them: GPT-NeoX with partial
# rotary (`rotary_pct`) and parallel residual; StableLM with grouped-query heads,
# `partial_rotary_factor`, q/k/v bias and per-head q/k LayerNorm.
FALLBACK_FAMILIES = {
    "gpt_neox": ("GPTNeoXConfig", "GPTNeoXForCausalLM", {"rotary_pct": 0.5, "use_parallel_residual": True}),
    "stablelm": ("StableLmConfig", "StableLmForCausalLM", {"num_key_value_heads": 2, "partial_rotary_factor": 0.25,
                                                          "use_qkv_bias": True, "qk_layernorm": True}),
}
# One mixed batch: prompts of 5..100 tokens chunked through a 16-token budget, two sharing a 40-token
# prefix (prefix caching must find it); then the same with too few blocks, so requests are preempted.
RUNS = {
    "chunked_prefix_cached": dict(enable_chunked_prefill=True, max_num_batched_tokens=16, max_num_seqs=8,
                                  enable_prefix_caching=True, block_size=8),
    "preemption": CASES["preemption"],
}


def _save_fallback_family(path, family: str) -> str:
    import torch
    import transformers

    config_name, model_name, extra = FALLBACK_FAMILIES[family]
    config = getattr(transformers, config_name)(**{**_SIZES, **extra})
    torch.manual_seed(1234)
    model = getattr(transformers, model_name)(config).eval()
    with torch.no_grad():  # biases and norm weights start at 0 / 1: make them matter
        for name, p in model.named_parameters():
            if name.endswith("bias"):
                p.normal_(0, 0.2)
            elif "norm" in name:
                p.uniform_(0.5, 1.5)
    model.save_pretrained(str(path))
    return str(path)


@pytest.fixture(scope="module", params=list(FALLBACK_FAMILIES))
def fallback_family(request, tmp_path_factory):
    path = _save_fallback_family(tmp_path_factory.mktemp(request.param), request.param)
    return path, hf_greedy(path, PROMPTS, MAX_NEW, ignore_eos=True)


@pytest.mark.parametrize("run", list(RUNS))
def test_fallback_family_matches_hf(fallback_family, run, stat_totals):
    path, reference = fallback_family
    llm = _llm(path, **RUNS[run])
    assert llm.engine.config.model.model_impl == "transformers"
    totals = stat_totals(llm)
    assert _generate(llm, PROMPTS) == reference
    assert totals.latest.num_used_blocks == 0
    if run == "chunked_prefix_cached":
        assert totals.prefix_cache_hits >= 32, "the shared 40-token prefix must be found in the cache"
    else:
        assert totals.num_preemptions > 0


# Families aserve implements, served by transformers instead: Llama (the native class as reference),
# Mistral with a 20-token window (prompts up to 100 tokens) and Gemma 2 (alternating windows,
# attention and final logit soft-capping).
NATIVE_FAMILIES = {
    "mistral-window": ("mistral", {"sliding_window": 20}),
    "gemma2": ("gemma2", {"head_dim": 16, "query_pre_attn_scalar": 16, "sliding_window": 20,
                          "num_hidden_layers": 4}),
}


def test_transformers_impl_on_llama_matches_native_class(tiny_llama):
    run = RUNS["chunked_prefix_cached"]
    native = _generate(_llm(tiny_llama, model_impl="aserve", **run), PROMPTS)
    fallback_llm = _llm(tiny_llama, model_impl="transformers", **run)
    assert fallback_llm.engine.config.model.model_impl == "transformers"
    assert _generate(fallback_llm, PROMPTS) == native == hf_greedy(tiny_llama, PROMPTS, MAX_NEW, ignore_eos=True)


@pytest.mark.parametrize("family", list(NATIVE_FAMILIES))
def test_transformers_impl_honours_windows_and_softcaps(family, tmp_path):
    name, overrides = NATIVE_FAMILIES[family]
    save_tiny_hf(tmp_path, name, seed=1234, perturb=True, **{**GREEDY_STABLE, **overrides})
    reference = hf_greedy(str(tmp_path), PROMPTS, MAX_NEW, ignore_eos=True)
    llm = _llm(str(tmp_path), model_impl="transformers", **RUNS["chunked_prefix_cached"])
    assert _generate(llm, PROMPTS) == reference


def test_aserve_impl_refuses_an_architecture_without_a_native_class(tmp_path):
    path = _save_fallback_family(tmp_path, "gpt_neox")
    with pytest.raises(ConfigError, match=r"^--model: architecture 'GPTNeoXForCausalLM' is not supported.*"
                                          r"supported: \[.*'LlamaForCausalLM'"):
        _llm(path, model_impl="aserve")


def test_auto_picks_the_transformers_backend_and_logs_it(tmp_path, caplog):
    path = _save_fallback_family(tmp_path, "gpt_neox")
    with caplog.at_level(logging.INFO, logger="aserve"):
        llm = _llm(path, load_format="dummy")
    assert llm.engine.config.model.model_impl == "transformers"
    assert "aserve has no native GPTNeoXForCausalLM; using the Transformers backend" in caplog.text
    assert "Transformers backend: GPTNeoXForCausalLM" in caplog.text  # the model layer's load line


def _write_config(path, cfg: dict) -> str:
    (path / "config.json").write_text(json.dumps(cfg))
    return str(path)


@pytest.mark.parametrize("model_impl", ["auto", "transformers"])
@pytest.mark.parametrize("config_name,reason", [("T5Config", "encoder-decoder"), ("BartConfig", "encoder-decoder")])
def test_encoder_decoder_is_refused_with_the_reason(tmp_path, model_impl, config_name, reason):
    import transformers

    config = getattr(transformers, config_name)(vocab_size=512, d_model=64)
    config.architectures = [config_name.replace("Config", "ForConditionalGeneration")]
    config.save_pretrained(str(tmp_path))
    flag = "--model" if model_impl == "auto" else "--model-impl"
    with pytest.raises(ConfigError, match=rf"^{flag}: .*ForConditionalGeneration.*{reason}"):
        _llm(str(tmp_path), model_impl=model_impl, load_format="dummy")


def test_attention_outside_the_interface_is_refused_at_load(tmp_path):
    """GPT-Neo computes attention itself (with its own local-window mask): transformers cannot switch
    it to the registered function, and it is refused rather than served with the wrong attention."""
    import transformers

    transformers.GPTNeoConfig(vocab_size=512, hidden_size=64, num_layers=2, num_heads=4,
                              attention_types=[[["global", "local"], 1]], max_position_embeddings=256,
                              window_size=16).save_pretrained(str(tmp_path))
    with pytest.raises(ValueError, match=r"GPTNeoForCausalLM: its attention is not routed through "
                                         r"transformers' AttentionInterface"):
        _llm(str(tmp_path), model_impl="transformers", load_format="dummy")


def test_transformers_backend_refuses_what_it_does_not_implement(tiny_llama):
    with pytest.raises(ConfigError, match=r"^--compilation-config: -O3 .* Transformers backend"):
        LLM(tiny_llama, model_impl="transformers", compilation_config=3, skip_tokenizer_init=True)
    with pytest.raises(ConfigError, match=r"^--quantization: .* Transformers backend"):
        LLM(tiny_llama, model_impl="transformers", quantization="int8", skip_tokenizer_init=True)
