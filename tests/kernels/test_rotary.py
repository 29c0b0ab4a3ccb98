"""rotary_embedding (neox and GPT-J styles, full and partial rotary dims) against the reference."""

from __future__ import annotations

import pytest
import torch
from aserve.kernels import reference
from aserve.kernels.rotary import rotary_embedding

TOL = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 2e-2}


def _cos_sin_cache(max_pos, rot_dim, base=10000.0, factor=1.0):
    inv_freq = 1.0 / (base ** (torch.arange(0, rot_dim, 2, dtype=torch.float32) / rot_dim))
    freqs = torch.outer(torch.arange(max_pos, dtype=torch.float32) / factor, inv_freq)
    return torch.cat([freqs.cos(), freqs.sin()], dim=-1)


@pytest.mark.parametrize("is_neox", [True, False], ids=["neox", "gptj"])
@pytest.mark.parametrize(
    "num_heads, num_kv_heads, head_dim, rot_dim, dtype",
    [(4, 2, 64, 64, torch.float32), (3, 1, 80, 40, torch.float32), (2, 2, 128, 128, torch.float16),
     (4, 1, 64, 32, torch.bfloat16)],
    ids=["full-d64", "partial-d80", "fp16-d128", "partial-bf16"],
)  # fmt: skip
def test_matches_reference(device, gen, is_neox, num_heads, num_kv_heads, head_dim, rot_dim, dtype):
    positions = torch.tensor([0, 5, 99, 17, 5], device=device)
    q = torch.randn(5, num_heads, head_dim, generator=gen).to(dtype).to(device)
    k = torch.randn(5, num_kv_heads, head_dim, generator=gen).to(dtype).to(device)
    cache = _cos_sin_cache(100, rot_dim, factor=2.0).to(device)  # a linear-scaled cache
    q_before, k_before = q.clone(), k.clone()
    got_q, got_k = rotary_embedding(positions, q, k, cache, is_neox)
    want_q, want_k = reference.rotary_embedding(positions, q, k, cache, is_neox)
    assert torch.equal(q, q_before) and torch.equal(k, k_before)
    torch.testing.assert_close(got_q.float(), want_q.float(), atol=TOL[dtype], rtol=TOL[dtype])
    torch.testing.assert_close(got_k.float(), want_k.float(), atol=TOL[dtype], rtol=TOL[dtype])
    # the dims past rot_dim pass through untouched
    assert torch.equal(got_q[..., rot_dim:], q[..., rot_dim:])


def test_position_zero_is_identity_and_int32_positions(device, gen):
    q = torch.randn(2, 2, 64, generator=gen).to(device)
    k = torch.randn(2, 1, 64, generator=gen).to(device)
    got_q, got_k = rotary_embedding(
        torch.zeros(2, dtype=torch.int32, device=device), q, k, _cos_sin_cache(4, 64).to(device)
    )
    assert torch.equal(got_q, q) and torch.equal(got_k, k)


def test_strided_q_k_views(device, gen):
    qkv = torch.randn(3, 4, 64, generator=gen).to(device)
    q, k = qkv[:, :2], qkv[:, 2:3]
    positions = torch.tensor([1, 2, 3], device=device)
    cache = _cos_sin_cache(8, 64).to(device)
    got = rotary_embedding(positions, q, k, cache)
    want = reference.rotary_embedding(positions, q, k, cache)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


def test_bad_input_names_the_argument():
    q, k = torch.zeros(2, 2, 64), torch.zeros(2, 1, 64)
    with pytest.raises(ValueError, match="rot_dim"):
        rotary_embedding(torch.zeros(2, dtype=torch.int64), q, k, torch.zeros(4, 66))
    with pytest.raises(ValueError, match="positions"):
        rotary_embedding(torch.zeros(3, dtype=torch.int64), q, k, torch.zeros(4, 64))
    with pytest.raises(ValueError, match="k: dtype"):
        rotary_embedding(torch.zeros(2, dtype=torch.int64), q, k.half(), torch.zeros(4, 64))
