"""The native Llama-family model over the paged KV cache equals Hugging Face transformers (fp32)."""

from __future__ import annotations

import random

import pytest
import torch

from tests.model._tiny_models import hf_logits, load_ours, random_schedule, run_schedule
from tests.support.tiny_models import VOCAB, save_tiny_hf

ATOL = 1e-4


def _prompts(lengths: list[int], seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(VOCAB) for _ in range(n)] for n in lengths]


def _assert_matches_hf(hf_model, prompts, logits):
    for tokens, got in zip(prompts, logits, strict=True):
        torch.testing.assert_close(got, hf_logits(hf_model, tokens), atol=ATOL, rtol=1e-4)


@pytest.fixture(scope="module")
def llama_tied(tmp_path_factory):
    path = tmp_path_factory.mktemp("llama_tied")
    hf = save_tiny_hf(path, "llama", tie_word_embeddings=True)
    return hf, load_ours(path)


@pytest.mark.parametrize("block_size", [8, 16, 32])
def test_packed_full_prefill(llama_tied, block_size):
    hf, ours = llama_tied
    prompts = _prompts([5, 17, 33, 1, 40])
    logits = run_schedule(ours, prompts, [[(i, len(p)) for i, p in enumerate(prompts)]], block_size)
    _assert_matches_hf(hf, prompts, logits)


@pytest.mark.parametrize("block_size", [8, 16, 32])
def test_chunked_prefill_over_cached_context(llama_tied, block_size):
    hf, ours = llama_tied
    prompts = _prompts([30, 45, 9], seed=1)
    steps = [
        [(0, 7), (1, 16)],
        [(0, 13), (1, 16), (2, 9)],
        [(0, 10), (1, 13)],
    ]
    _assert_matches_hf(hf, prompts, run_schedule(ours, prompts, steps, block_size, seed=block_size))


@pytest.mark.parametrize("block_size", [8, 16, 32])
def test_decode_steps_mixed_with_prefill(llama_tied, block_size):
    hf, ours = llama_tied
    prompts = _prompts([13, 26, 8, 20], seed=2)
    steps = [[(0, 9), (1, 20)]]  # prefill two sequences (all but a few tokens)
    steps += [[(0, 1), (1, 1)] for _ in range(3)]  # batched decodes
    steps += [[(0, 1), (1, 1), (2, 8)]]  # decodes plus a new prompt in the same batch
    steps += [[(1, 1)], [(1, 1)]]
    steps += [[(3, 20)]]
    _assert_matches_hf(hf, prompts, run_schedule(ours, prompts, steps, block_size, seed=7))


@pytest.mark.parametrize("seed", range(3))
def test_random_schedules(llama_tied, seed):
    hf, ours = llama_tied
    lengths = [random.Random(seed).randint(1, 50) for _ in range(5)]
    prompts = _prompts(lengths, seed=seed)
    block_size = (8, 16, 32)[seed % 3]
    steps = random_schedule(lengths, seed)
    _assert_matches_hf(hf, prompts, run_schedule(ours, prompts, steps, block_size, num_blocks=64, seed=seed))


@pytest.mark.parametrize(
    ("family", "overrides"),
    [
        pytest.param("qwen2", {}, id="qwen2-qkv-bias"),
        pytest.param("llama", {"attention_bias": True, "tie_word_embeddings": False}, id="llama-attention-bias"),
        pytest.param("llama", {"rope_parameters": {"rope_type": "llama3", "rope_theta": 10000.0, "factor": 8.0,
                                                   "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                                   "original_max_position_embeddings": 32}}, id="rope-llama3"),
        pytest.param("llama", {"rope_parameters": {"rope_type": "linear", "rope_theta": 10000.0, "factor": 2.0}},
                     id="rope-linear"),
        pytest.param("llama", {"rope_parameters": {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
                                                   "original_max_position_embeddings": 32}}, id="rope-yarn"),
        pytest.param("mistral", {"sliding_window": 8}, id="mistral-sliding-window"),
        pytest.param("qwen2", {"use_sliding_window": True, "sliding_window": 8, "max_window_layers": 0},
                     id="qwen2-sliding-window-every-layer"),
        pytest.param("qwen2", {"use_sliding_window": True, "sliding_window": 8, "max_window_layers": 2},
                     id="qwen2-sliding-window-no-layer"),
        pytest.param("qwen2", {"use_sliding_window": False, "sliding_window": 8, "max_window_layers": 1},
                     id="qwen2-sliding-window-off"),
        pytest.param("qwen2", {"use_sliding_window": True, "sliding_window": 8, "max_window_layers": 1},
                     id="qwen2-sliding-window-later-layers"),
        pytest.param("qwen2", {"use_sliding_window": True, "sliding_window": 6,
                               "layer_types": ["sliding_attention", "full_attention"]}, id="qwen2-layer-types"),
        pytest.param("qwen3", {}, id="qwen3-qk-norm"),
        pytest.param("qwen3", {"attention_bias": True, "tie_word_embeddings": True}, id="qwen3-bias-tied"),
        pytest.param("qwen3", {"use_sliding_window": True, "sliding_window": 8, "max_window_layers": 1,
                               "head_dim": 32}, id="qwen3-per-layer-window-head-dim-32"),
        pytest.param("llama", {"num_key_value_heads": 1, "head_dim": 32}, id="mqa-head-dim-32"),
    ],
)
def test_architecture_variants(tmp_path, family, overrides):
    hf = save_tiny_hf(tmp_path, family, seed=3, **overrides)
    ours = load_ours(tmp_path)
    lengths = [37, 6, 50, 21]
    prompts = _prompts(lengths, seed=4)
    steps = random_schedule(lengths, seed=5)
    _assert_matches_hf(hf, prompts, run_schedule(ours, prompts, steps, block_size=16, seed=6))


def test_sliding_window_comes_from_the_model_config(tmp_path):
    """The model applies its own window even when the metadata says none."""
    hf = save_tiny_hf(tmp_path, "mistral", sliding_window=4)
    ours = load_ours(tmp_path)
    assert ours.arch.layer_sliding_windows == (4, 4)
    assert [attn.sliding_window for attn in ours.attention_layers] == [4, 4]
    prompts = _prompts([20], seed=8)
    logits = run_schedule(ours, prompts, [[(0, 12)], [(0, 1)], [(0, 7)]], block_size=8)
    _assert_matches_hf(hf, prompts, logits)


def test_bfloat16_model_tracks_float32(tmp_path):
    save_tiny_hf(tmp_path, "llama")
    fp32, bf16 = load_ours(tmp_path, "float32"), load_ours(tmp_path, "bfloat16")
    assert bf16.model.embed_tokens.weight.dtype == torch.bfloat16
    prompts = _prompts([19, 4], seed=9)
    steps = [[(0, 10), (1, 3)], [(1, 1), (0, 9)]]
    want = run_schedule(fp32, prompts, steps, block_size=8)
    got = run_schedule(bf16, prompts, steps, block_size=8)
    for g, w in zip(got, want, strict=True):
        assert g.dtype == torch.float32
        torch.testing.assert_close(g, w, atol=0.05, rtol=0.05)


def test_tied_lm_head_shares_the_embedding(llama_tied):
    _, ours = llama_tied
    assert ours.lm_head.weight is ours.model.embed_tokens.weight


def test_bind_kv_caches_validates(llama_tied):
    _, ours = llama_tied
    arch = ours.arch
    good = torch.zeros(2, 4, 8, arch.num_key_value_heads, arch.head_dim)
    with pytest.raises(ValueError, match="one per layer"):
        ours.bind_kv_caches([good])
    with pytest.raises(ValueError, match="KV cache must be"):
        ours.bind_kv_caches([torch.zeros(2, 4, 8, arch.num_key_value_heads + 1, arch.head_dim)] * 2)


def test_forward_without_kv_cache_raises(tmp_path):
    save_tiny_hf(tmp_path, "llama")
    ours = load_ours(tmp_path)
    from tests.model._paged_batch import PagedBatch

    ids, pos, meta = PagedBatch(2, 2, 16, 8, 4).step([(0, [1, 2, 3])])
    with pytest.raises(RuntimeError, match="bind_kv_caches"):
        ours(ids, pos, meta)
