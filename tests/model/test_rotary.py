"""RoPE tables against transformers' rope initialisation functions."""

from __future__ import annotations

import pytest
import torch
from transformers import LlamaConfig
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

from aserve.model.layers.rotary import RotaryEmbedding

HEAD_DIM, MAX_POS, THETA = 32, 64, 10000.0


def _hf_table(rope_parameters: dict, num_positions: int, seq_len: int | None = None) -> torch.Tensor:
    config = LlamaConfig(hidden_size=128, num_attention_heads=4, max_position_embeddings=MAX_POS,
                         rope_parameters={"rope_theta": THETA, **rope_parameters})
    kind = rope_parameters["rope_type"]
    if kind == "default":
        inv_freq = 1.0 / THETA ** (torch.arange(0, HEAD_DIM, 2).float() / HEAD_DIM)
        factor = 1.0
    else:
        inv_freq, factor = ROPE_INIT_FUNCTIONS[kind](config, "cpu", seq_len=seq_len)
    freqs = torch.outer(torch.arange(num_positions).float(), inv_freq)
    return torch.cat((freqs.cos() * factor, freqs.sin() * factor), dim=-1)


@pytest.mark.parametrize(
    ("params", "num_positions"),
    [
        ({"rope_type": "default"}, MAX_POS),
        ({"rope_type": "linear", "factor": 4.0}, MAX_POS * 4),
        ({"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
          "original_max_position_embeddings": 16}, MAX_POS),
        ({"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 16}, MAX_POS * 4),
        ({"rope_type": "yarn", "factor": 2.0, "original_max_position_embeddings": 32, "beta_fast": 16,
          "beta_slow": 2, "mscale": 1.0, "mscale_all_dim": 0.5}, MAX_POS * 2),
    ],
)
def test_cos_sin_table_matches_transformers(params, num_positions):
    rope = RotaryEmbedding(HEAD_DIM, HEAD_DIM, MAX_POS, THETA, None if params["rope_type"] == "default" else params)
    assert rope.max_position == num_positions
    torch.testing.assert_close(rope.cos_sin_cache, _hf_table(params, num_positions), atol=1e-6, rtol=1e-6)


def test_dynamic_ntk_uses_the_base_for_the_full_extended_length():
    params = {"rope_type": "dynamic", "factor": 2.0}
    rope = RotaryEmbedding(HEAD_DIM, HEAD_DIM, MAX_POS, THETA, params)
    assert rope.max_position == MAX_POS * 2
    want = _hf_table(params, MAX_POS * 2, seq_len=MAX_POS * 2)
    torch.testing.assert_close(rope.cos_sin_cache, want, atol=1e-6, rtol=1e-6)


def test_table_is_stored_in_the_model_dtype():
    rope = RotaryEmbedding(HEAD_DIM, HEAD_DIM, MAX_POS, THETA, dtype=torch.bfloat16)
    assert rope.cos_sin_cache.dtype == torch.bfloat16


def test_unsupported_rope_type_raises():
    with pytest.raises(ValueError, match="not implemented"):
        RotaryEmbedding(HEAD_DIM, HEAD_DIM, MAX_POS, THETA, {"rope_type": "mrope", "factor": 2.0})


@pytest.mark.parametrize(("partial", "extra"), [(1.0, {}), (0.5, {}), (0.5, {"factor": 8.0}),
                                                 (1.0, {"attention_factor": 1.3})])
def test_longrope_table_matches_transformers_per_factor_set(partial, extra):
    """Rows below original_max_position_embeddings are transformers' short-factor frequencies (what it
    uses while a sequence stays within that length), the rows from there on its long-factor ones
    (what it uses for every position once a sequence is longer)."""
    from transformers import Phi3Config

    original, rotary_dim = 16, int(HEAD_DIM * partial)
    params = {"rope_type": "longrope", "rope_theta": THETA, "partial_rotary_factor": partial,
              "short_factor": [1.0 + 0.1 * i for i in range(rotary_dim // 2)],
              "long_factor": [2.0 + 0.7 * i for i in range(rotary_dim // 2)], **extra}
    config = Phi3Config(hidden_size=128, num_attention_heads=4, max_position_embeddings=MAX_POS,
                        original_max_position_embeddings=original, rope_parameters=dict(params),
                        pad_token_id=None, eos_token_id=None)
    want = []
    for seq_len, rows in ((original, range(original)), (original + 1, range(original, MAX_POS))):
        inv_freq, factor = ROPE_INIT_FUNCTIONS["longrope"](config, "cpu", seq_len=seq_len)
        freqs = torch.outer(torch.tensor(list(rows), dtype=torch.float32), inv_freq)
        want.append(torch.cat((freqs.cos() * factor, freqs.sin() * factor), dim=-1))
    scaling = {**params, "original_max_position_embeddings": original}
    rope = RotaryEmbedding(HEAD_DIM, rotary_dim, MAX_POS, THETA, scaling)
    assert rope.max_position == MAX_POS  # max_position_embeddings already is the extended context
    torch.testing.assert_close(rope.cos_sin_cache, torch.cat(want), atol=1e-6, rtol=1e-6)


def test_longrope_factor_lists_must_fit_the_rotary_dims():
    scaling = {"rope_type": "longrope", "short_factor": [1.0] * 4, "long_factor": [1.0] * 4,
               "original_max_position_embeddings": 16}
    with pytest.raises(ValueError, match="short_factor has 4 entries"):
        RotaryEmbedding(HEAD_DIM, HEAD_DIM, MAX_POS, THETA, scaling)
