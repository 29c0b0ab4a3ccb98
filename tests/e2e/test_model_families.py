"""Every model family aserve serves natively: greedy tokens identical to Hugging Face transformers
(fp32, tiny random weights built here) through `LLM.generate`, under chunked prefill, prefix caching
and preemption, and once through the `mp` executor. Families with per-layer attention windows run
prompts longer than their windows, so a layer that used the wrong window would change the tokens."""

from __future__ import annotations

import pytest

from tests.e2e.test_hf_equivalence import CASES, PROMPTS, _generate, _llm
from tests.support.tiny_models import GREEDY_STABLE, hf_greedy, save_tiny_hf

MAX_NEW = 12

FAMILIES = {
    "qwen3": ("qwen3", {"tie_word_embeddings": True}),
    "qwen3-per-layer-window": ("qwen3", {"use_sliding_window": True, "sliding_window": 16,
                                         "max_window_layers": 1, "head_dim": 32}),
    "qwen2-layer-types": ("qwen2", {"use_sliding_window": True, "sliding_window": 12,
                                    "layer_types": ["sliding_attention", "full_attention"]}),
    "mistral-window": ("mistral", {"sliding_window": 20}),
    "phi3": ("phi3", {}),
    # Partial rotary (8 of 16 dims) with longrope: every sequence (<= 112 tokens) stays within
    # original_max_position_embeddings, where transformers uses the short factors too.
    "phi3-longrope-partial-window": ("phi3", {
        "partial_rotary_factor": 0.5, "original_max_position_embeddings": 128, "sliding_window": 20,
        "tie_word_embeddings": True,
        "rope_parameters": {"rope_type": "longrope", "rope_theta": 10000.0,
                            "short_factor": [1.0, 1.1, 1.3, 1.6], "long_factor": [2.0, 3.0, 5.0, 8.0]}}),
    "gemma2": ("gemma2", {"head_dim": 16, "query_pre_attn_scalar": 16, "sliding_window": 20,
                          "num_hidden_layers": 4}),
    "gemma3": ("gemma3", {"head_dim": 16, "query_pre_attn_scalar": 16, "sliding_window": 20,
                          "num_hidden_layers": 6}),
    # Learned positions, LayerNorm, fused Conv1D q|k|v; OPT as opt-350m: post-LN with project_in/out.
    "gpt2": ("gpt2", {}),
    "opt": ("opt", {}),
    "opt-post-ln-projected": ("opt", {"do_layer_norm_before": False, "word_embed_proj_dim": 32}),
    # Mixture of experts (4-8 experts, top 2): Mixtral with Mistral's window; Qwen2-MoE with its shared
    # expert and a dense middle layer; Qwen3-MoE with q/k norm and renormalized top-k.
    "mixtral-window": ("mixtral", {"sliding_window": 20}),
    "qwen2-moe-shared-dense-mix": ("qwen2_moe", {"num_hidden_layers": 3, "mlp_only_layers": [1]}),
    "qwen3-moe": ("qwen3_moe", {}),
}
RUNS = ["defaults", "chunked_tiny_budget", "prefix_caching", "preemption", "mp"]


@pytest.fixture(scope="module", params=list(FAMILIES))
def family(request, tmp_path_factory):
    name, overrides = FAMILIES[request.param]
    path = tmp_path_factory.mktemp(request.param)
    save_tiny_hf(path, name, seed=1234, perturb=True, **{**GREEDY_STABLE, **overrides})
    return str(path), hf_greedy(str(path), PROMPTS, MAX_NEW, ignore_eos=True)


@pytest.mark.parametrize("run", RUNS)
def test_family_matches_hf(family, run, stat_totals):
    path, reference = family
    kwargs = {"distributed_executor_backend": "mp"} if run == "mp" else CASES[run]
    llm = _llm(path, **kwargs)
    try:
        totals = stat_totals(llm)
        assert _generate(llm, PROMPTS) == reference
        if run == "preemption":
            assert totals.num_preemptions > 0
        if run == "prefix_caching":
            assert totals.prefix_cache_hits >= 32
    finally:
        if run == "mp":
            llm.engine.shutdown()
