"""Gemma 2 and Gemma 3 (text) over the paged KV cache equal Hugging Face transformers (fp32): `(1 + w)`
norms, scaled embeddings, GeGLU, query_pre_attn_scalar, attention and final logit soft-capping
(Gemma 2), per-head q/k norms and a local RoPE base (Gemma 3), alternating sliding and global layers."""

from __future__ import annotations

import pytest
import torch

from tests.model._tiny_models import hf_logits, load_ours, random_schedule, run_schedule
from tests.model.test_llama import _prompts
from tests.support.tiny_models import save_tiny_hf

SMALL = {"head_dim": 16, "query_pre_attn_scalar": 16, "sliding_window": 8, "num_hidden_layers": 4}


@pytest.mark.parametrize(("family", "overrides"), [
    pytest.param("gemma2", {}, id="gemma2"),
    pytest.param("gemma2", {"attn_logit_softcapping": 5.0, "final_logit_softcapping": 3.0,
                            "query_pre_attn_scalar": 24}, id="gemma2-tight-caps"),
    pytest.param("gemma2", {"attn_logit_softcapping": None, "final_logit_softcapping": None}, id="gemma2-no-caps"),
    pytest.param("gemma3", {"num_hidden_layers": 6}, id="gemma3"),
    pytest.param("gemma3", {"layer_types": ["sliding_attention", "full_attention"] * 2,
                            "rope_parameters": {"full_attention": {"rope_type": "linear", "factor": 2.0,
                                                                   "rope_theta": 500000.0},
                                                "sliding_attention": {"rope_type": "default",
                                                                      "rope_theta": 10000.0}}},
                 id="gemma3-scaled-global-rope"),
])
def test_gemma_matches_hf(tmp_path, family, overrides):
    hf = save_tiny_hf(tmp_path, family, seed=11, **{**SMALL, **overrides})
    ours = load_ours(tmp_path)
    windows = [attn.sliding_window for attn in ours.attention_layers]
    assert None in windows and 8 in windows  # both kinds of layer are exercised
    lengths = [37, 6, 50, 21]
    prompts = _prompts(lengths, seed=4)
    logits = run_schedule(ours, prompts, random_schedule(lengths, seed=5), block_size=16, seed=6)
    for tokens, got in zip(prompts, logits, strict=True):
        torch.testing.assert_close(got, hf_logits(hf, tokens), atol=1e-4, rtol=1e-4)


def test_image_text_gemma3_is_refused_with_the_reason(tmp_path):
    import json

    from aserve.config import ConfigError, EngineArgs

    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["Gemma3ForConditionalGeneration"],
                                                      "text_config": {"hidden_size": 64}}))
    with pytest.raises(ConfigError, match="^--model: .*Gemma3ForConditionalGeneration.*text-only.*Gemma3ForCausalLM"):
        EngineArgs(model=str(tmp_path)).create_config()
