"""Phi-3 over the paged KV cache equals Hugging Face transformers' Phi3ForCausalLM (fp32): fused
qkv / gate_up checkpoints, partial rotary, longrope scaling, tied LM head, sliding window; and its
config.json fields read as transformers reads them."""

from __future__ import annotations

import math
import random

import pytest
import torch

from aserve.config import ArchConfig
from aserve.config.hf_config import derived_max_model_len
from tests.model._tiny_models import hf_logits, load_ours, random_schedule, run_schedule
from tests.support.tiny_models import VOCAB, save_tiny_hf

HEAD_DIM = 16  # tiny models: hidden 64 / 4 heads


def _longrope(rotary_dim: int = HEAD_DIM) -> dict:
    half = rotary_dim // 2
    return {"rope_type": "longrope", "rope_theta": 10000.0,
            "short_factor": [1.0 + 0.07 * i for i in range(half)],
            "long_factor": [1.5 + 0.6 * i for i in range(half)]}


def _prompts(lengths: list[int], seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(VOCAB) for _ in range(n)] for n in lengths]


@pytest.mark.parametrize(
    "overrides",
    [
        pytest.param({}, id="plain"),
        pytest.param({"partial_rotary_factor": 0.5}, id="partial-rotary-0.5"),
        # Every sequence stays within original_max_position_embeddings (64 < 256 = max_position_embeddings,
        # so factor 4 and an attention factor != 1): transformers uses the short factors throughout.
        pytest.param({"rope_parameters": _longrope(), "original_max_position_embeddings": 64}, id="longrope"),
        pytest.param({"partial_rotary_factor": 0.5, "rope_parameters": _longrope(HEAD_DIM // 2),
                      "original_max_position_embeddings": 64}, id="longrope-partial-rotary"),
        pytest.param({"tie_word_embeddings": True}, id="tied"),
        pytest.param({"sliding_window": 8}, id="sliding-window"),
    ],
)
def test_phi3_matches_transformers(tmp_path, overrides):
    hf = save_tiny_hf(tmp_path, "phi3", seed=3, **overrides)
    ours = load_ours(tmp_path)
    lengths = [37, 6, 50, 21]
    prompts = _prompts(lengths, seed=4)
    logits = run_schedule(ours, prompts, random_schedule(lengths, seed=5), block_size=16, seed=6)
    for tokens, got in zip(prompts, logits, strict=True):
        torch.testing.assert_close(got, hf_logits(hf, tokens), atol=1e-4, rtol=1e-4)


def test_phi3_layout(tmp_path):
    save_tiny_hf(tmp_path, "phi3", partial_rotary_factor=0.5, tie_word_embeddings=True, sliding_window=8)
    ours = load_ours(tmp_path)
    assert ours.model.rotary.rotary_dim == HEAD_DIM // 2
    assert ours.lm_head.weight is ours.model.embed_tokens.weight
    assert [attn.sliding_window for attn in ours.attention_layers] == [8, 8]  # transformers 5: every layer
    layer = ours.model.layers[0]
    assert layer.self_attn.qkv_proj.bias is None and layer.self_attn.o_proj.bias is None


def test_phi3_bfloat16_tracks_float32(tmp_path):
    """The 16-bit rotary paths (C kernel or fused multiply-adds) leave the pass-through dims alone."""
    save_tiny_hf(tmp_path, "phi3", partial_rotary_factor=0.5)
    fp32, bf16 = load_ours(tmp_path, "float32"), load_ours(tmp_path, "bfloat16")
    prompts = _prompts([19, 4], seed=9)
    steps = [[(0, 10), (1, 3)], [(1, 1), (0, 9)]]
    want = run_schedule(fp32, prompts, steps, block_size=8)
    for got, ref in zip(run_schedule(bf16, prompts, steps, block_size=8), want, strict=True):
        torch.testing.assert_close(got, ref, atol=0.05, rtol=0.05)


_BASE = {"architectures": ["Phi3ForCausalLM"], "vocab_size": 100, "hidden_size": 64, "intermediate_size": 96,
         "num_hidden_layers": 2, "num_attention_heads": 4, "max_position_embeddings": 131072}


def test_legacy_longrope_config_reads_as_transformers():
    """A pre-transformers-5 Phi-3-128k config: `rope_scaling` with the old type name "su", the
    pre-training length at the top level, `partial_rotary_factor` at the top level (Phi-4-mini)."""
    short, long = [1.0] * 6, [2.0] * 6
    for kind in ("su", "yarn", "longrope"):  # Phi3Config reads "su" and "yarn" as longrope
        scaling = {"type": kind, "short_factor": short, "long_factor": long}
        arch = ArchConfig.from_hf_dict({**_BASE, "original_max_position_embeddings": 4096,
                                        "partial_rotary_factor": 0.75, "rope_scaling": scaling})
        assert arch.rope_scaling["rope_type"] == "longrope"
        assert arch.rope_scaling["original_max_position_embeddings"] == 4096
        assert arch.family.rotary_dim(arch.head_dim) == 12
    # The context is max_position_embeddings itself (not times a factor).
    assert derived_max_model_len(arch) == 131072


def test_original_max_position_embeddings_follows_transformers():
    rope = {"rope_type": "longrope", "rope_theta": 1e4, "short_factor": [1.0] * 8, "long_factor": [2.0] * 8,
            "original_max_position_embeddings": 2048, "factor": 32.0}
    # The top-level key wins over the RoPE dict's; absent, Phi3Config's class default (4096) does.
    top = ArchConfig.from_hf_dict({**_BASE, "rope_parameters": rope,
                                   "original_max_position_embeddings": 1024})
    assert top.rope_scaling["original_max_position_embeddings"] == 1024
    arch = ArchConfig.from_hf_dict({**_BASE, "rope_parameters": rope})
    assert arch.rope_scaling["original_max_position_embeddings"] == 4096
    assert derived_max_model_len(arch) == 131072  # "factor" does not extend a longrope context
    assert arch.family.partial_rotary_factor == 1.0
    # partial_rotary_factor inside rope_parameters (transformers 5) wins over the top-level key.
    rope = {"rope_type": "default", "partial_rotary_factor": 0.5}
    arch = ArchConfig.from_hf_dict({**_BASE, "partial_rotary_factor": 0.25, "rope_parameters": rope})
    assert arch.rope_scaling is None and arch.family.rotary_dim(arch.head_dim) == 8


def test_sliding_window_on_every_layer():
    arch = ArchConfig.from_hf_dict({**_BASE, "sliding_window": 2047})
    assert arch.layer_sliding_windows == (2047, 2047)
    assert ArchConfig.from_hf_dict({**_BASE, "sliding_window": None}).layer_sliding_windows == (None, None)


def test_longrope_attention_factor_default():
    """sqrt(1 + ln(factor) / ln(original)) with factor = max_position_embeddings / original."""
    from aserve.model.layers.rotary import RotaryEmbedding

    scaling = {**_longrope(), "original_max_position_embeddings": 64}
    rope = RotaryEmbedding(HEAD_DIM, HEAD_DIM, 256, 10000.0, scaling)
    want = math.sqrt(1 + math.log(4) / math.log(64))
    half = HEAD_DIM // 2
    cos0 = rope.cos_sin_cache[0, :half]  # position 0: cos = 1 before the factor
    torch.testing.assert_close(cos0, torch.full((half,), want), atol=1e-6, rtol=1e-6)
