"""aserve.kernels.reference against naive dense implementations (explicit masks, gathered K/V)."""

from __future__ import annotations

import math
import random

import pytest
import torch
import torch.nn.functional as F

from aserve.kernels import reference
from tests.model._paged_batch import naive_attention


def make_paged(seq_lens: list[int], block_size: int, num_kv_heads: int, head_dim: int, seed: int,
               dtype: torch.dtype = torch.float32, extra_blocks: int = 3):
    """A random cache with shuffled block tables (padded with 0) covering `seq_lens`; returns
    (kv_cache, block_tables, dense K/V per sequence [L, KVH, D])."""
    gen = torch.Generator().manual_seed(seed)
    needed = [math.ceil(n / block_size) for n in seq_lens]
    num_blocks = sum(needed) + extra_blocks
    cache = torch.randn(2, num_blocks, block_size, num_kv_heads, head_dim, generator=gen).to(dtype)
    ids = list(range(num_blocks))
    random.Random(seed).shuffle(ids)
    width = max(needed) + 2
    tables, dense = [], []
    for n, nb in zip(seq_lens, needed, strict=True):
        blocks, ids = ids[:nb], ids[nb:]
        tables.append(blocks + [0] * (width - nb))
        kv = cache[:, blocks].reshape(2, nb * block_size, num_kv_heads, head_dim)[:, :n]
        dense.append(kv)
    return cache, torch.tensor(tables, dtype=torch.int32), dense


@pytest.mark.parametrize("block_size", [8, 16, 32])
@pytest.mark.parametrize(("num_heads", "num_kv_heads"), [(4, 4), (8, 2), (9, 3)])
@pytest.mark.parametrize("sliding_window", [None, 5])
def test_paged_decode_attention_matches_dense(block_size, num_heads, num_kv_heads, sliding_window):
    seq_lens = [1, 7, 33, 64, 20]
    head_dim = 16
    cache, tables, dense = make_paged(seq_lens, block_size, num_kv_heads, head_dim, seed=block_size + num_heads)
    q = torch.randn(len(seq_lens), num_heads, head_dim)
    out = reference.paged_decode_attention(q, cache, tables, torch.tensor(seq_lens, dtype=torch.int32),
                                           scale=0.3, sliding_window=sliding_window)
    assert out.shape == q.shape and out.dtype == q.dtype
    for i, n in enumerate(seq_lens):
        want = naive_attention(q[i:i + 1], dense[i][0], dense[i][1], torch.tensor([n - 1]), 0.3, sliding_window)
        torch.testing.assert_close(out[i:i + 1], want, atol=1e-5, rtol=1e-5)


def test_paged_decode_attention_empty_batch():
    cache, tables, _ = make_paged([4], 8, 2, 8, seed=0)
    out = reference.paged_decode_attention(torch.empty(0, 4, 8), cache, tables[:0], torch.empty(0, dtype=torch.int32), 1.0)
    assert out.shape == (0, 4, 8)


@pytest.mark.parametrize("block_size", [8, 16, 32])
@pytest.mark.parametrize(("num_heads", "num_kv_heads"), [(4, 4), (6, 2)])
@pytest.mark.parametrize("sliding_window", [None, 6])
@pytest.mark.parametrize("host_lists", [True, False])
def test_paged_prefill_attention_matches_dense(block_size, num_heads, num_kv_heads, sliding_window, host_lists):
    # (context length, query length): fresh prefills, extends over cached context, a 1-token extend.
    shapes = [(13, 13), (40, 9), (5, 1), (70, 70), (33, 16)]
    seq_lens = [n for n, _ in shapes]
    q_lens = [m for _, m in shapes]
    head_dim = 16
    cache, tables, dense = make_paged(seq_lens, block_size, num_kv_heads, head_dim, seed=block_size)
    starts = [0]
    for m in q_lens:
        starts.append(starts[-1] + m)
    q = torch.randn(starts[-1], num_heads, head_dim)
    kwargs = {"query_start_loc_cpu": starts, "seq_lens_cpu": seq_lens} if host_lists else {}
    out = reference.paged_prefill_attention(
        q, cache, tables, torch.tensor(starts, dtype=torch.int32), torch.tensor(seq_lens, dtype=torch.int32),
        scale=0.25, sliding_window=sliding_window, **kwargs)
    for i, (n, m) in enumerate(shapes):
        q_pos = torch.arange(n - m, n)
        want = naive_attention(q[starts[i]:starts[i + 1]], dense[i][0], dense[i][1], q_pos, 0.25, sliding_window)
        torch.testing.assert_close(out[starts[i]:starts[i + 1]], want, atol=1e-5, rtol=1e-5)


def test_attention_in_bfloat16_is_close_to_fp32():
    seq_lens = [30, 9]
    cache, tables, _ = make_paged(seq_lens, 16, 2, 32, seed=3)
    q = torch.randn(2, 4, 32)
    lens = torch.tensor(seq_lens, dtype=torch.int32)
    want = reference.paged_decode_attention(q, cache, tables, lens, 0.2)
    got = reference.paged_decode_attention(q.bfloat16(), cache.bfloat16(), tables, lens, 0.2)
    assert got.dtype == torch.bfloat16
    torch.testing.assert_close(got.float(), want, atol=3e-2, rtol=3e-2)


def test_reshape_and_cache_writes_slots_and_skips_negative():
    num_blocks, block_size, kvh, d = 6, 4, 2, 8
    cache = torch.zeros(2, num_blocks, block_size, kvh, d)
    key, value = torch.randn(5, kvh, d), torch.randn(5, kvh, d)
    slots = torch.tensor([0, 9, -1, 23, 14])
    reference.reshape_and_cache(key, value, cache, slots)
    flat_k, flat_v = cache[0].reshape(-1, kvh, d), cache[1].reshape(-1, kvh, d)
    for t, s in enumerate(slots.tolist()):
        if s >= 0:
            assert torch.equal(flat_k[s], key[t]) and torch.equal(flat_v[s], value[t])
    written = {s for s in slots.tolist() if s >= 0}
    untouched = [s for s in range(num_blocks * block_size) if s not in written]
    assert flat_k[untouched].abs().sum() == 0 and flat_v[untouched].abs().sum() == 0


def test_reshape_and_cache_casts_to_cache_dtype():
    cache = torch.zeros(2, 2, 4, 1, 4, dtype=torch.bfloat16)
    key = torch.randn(2, 1, 4)
    reference.reshape_and_cache(key, key * 2, cache, torch.tensor([1, 6]))
    assert torch.equal(cache[0, 0, 1], key[0].bfloat16())
    assert torch.equal(cache[1, 1, 2], (key[1] * 2).bfloat16())


@pytest.mark.parametrize(("fp8", "tol"), [(torch.float8_e4m3fn, 0.07), (torch.float8_e5m2, 0.14)])
def test_fp8_cache_round_trip_and_attention(fp8, tol):
    num_blocks, block_size, kvh, d = 4, 8, 2, 16
    key, value = torch.randn(20, kvh, d), torch.randn(20, kvh, d)
    k_scale, v_scale = 0.5, 2.0
    cache = torch.zeros(2, num_blocks, block_size, kvh, d, dtype=fp8)
    reference.reshape_and_cache(key, value, cache, torch.arange(20), k_scale, v_scale)
    stored_k = cache[0].reshape(-1, kvh, d)[:20].float() * k_scale
    stored_v = cache[1].reshape(-1, kvh, d)[:20].float() * v_scale
    torch.testing.assert_close(stored_k, key, atol=tol * 2, rtol=tol)
    torch.testing.assert_close(stored_v, value, atol=tol * 4, rtol=tol)
    # Attention over the fp8 cache dequantizes with the same scales.
    tables = torch.tensor([[0, 1, 2]], dtype=torch.int32)
    q = torch.randn(1, 4, d)
    got = reference.paged_decode_attention(q, cache, tables, torch.tensor([20], dtype=torch.int32), 0.25,
                                           k_scale=k_scale, v_scale=v_scale)
    want = naive_attention(q, stored_k, stored_v, torch.tensor([19]), 0.25)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    got_prefill = reference.paged_prefill_attention(
        q.expand(1, 4, d), cache, tables, torch.tensor([0, 1], dtype=torch.int32),
        torch.tensor([20], dtype=torch.int32), 0.25, k_scale=k_scale, v_scale=v_scale)
    torch.testing.assert_close(got_prefill, want, atol=1e-5, rtol=1e-5)


def test_fp8_cache_saturates_instead_of_overflowing():
    cache = torch.zeros(2, 1, 4, 1, 2, dtype=torch.float8_e4m3fn)
    big = torch.tensor([[[1e6, -1e6]]])
    reference.reshape_and_cache(big, big, cache, torch.tensor([0]))
    assert cache[0, 0, 0, 0].float().tolist() == [448.0, -448.0]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rms_norm(dtype):
    x = torch.randn(5, 32).to(dtype)
    w = torch.randn(32).to(dtype)
    x32 = x.float()
    want = w * (x32 / torch.sqrt(x32.pow(2).mean(-1, keepdim=True) + 1e-6)).to(dtype)
    got = reference.rms_norm(x, w, 1e-6)
    assert got.dtype == dtype
    torch.testing.assert_close(got, want)
    residual = torch.randn(5, 32).to(dtype)
    normed, summed = reference.rms_norm(x, w, 1e-6, residual)
    torch.testing.assert_close(summed, x + residual)
    torch.testing.assert_close(normed, reference.rms_norm(x + residual, w, 1e-6))


def _cos_sin_cache(max_pos: int, rot_dim: int, base: float = 10000.0) -> torch.Tensor:
    inv = 1.0 / base ** (torch.arange(0, rot_dim, 2).float() / rot_dim)
    freqs = torch.outer(torch.arange(max_pos).float(), inv)
    return torch.cat((freqs.cos(), freqs.sin()), dim=-1)


def _rotate_complex(x: torch.Tensor, pos: torch.Tensor, rot_dim: int, base: float, is_neox: bool) -> torch.Tensor:
    """Naive RoPE via complex multiplication, one frequency per (pair) index."""
    inv = 1.0 / base ** (torch.arange(0, rot_dim, 2).float() / rot_dim)
    angles = pos.float()[:, None] * inv[None]  # [T, rot/2]
    rot = torch.polar(torch.ones_like(angles), angles)[:, None, :]
    xr = x[..., :rot_dim].float()
    if is_neox:
        pairs = torch.complex(xr[..., : rot_dim // 2], xr[..., rot_dim // 2:]) * rot
        out = torch.cat((pairs.real, pairs.imag), dim=-1)
    else:
        pairs = torch.complex(xr[..., 0::2], xr[..., 1::2]) * rot
        out = torch.stack((pairs.real, pairs.imag), dim=-1).flatten(-2)
    return torch.cat((out, x[..., rot_dim:].float()), dim=-1)


@pytest.mark.parametrize("is_neox", [True, False])
@pytest.mark.parametrize("rot_dim", [32, 16])
def test_rotary_embedding(is_neox, rot_dim):
    head_dim, T = 32, 7
    positions = torch.tensor([0, 3, 1, 99, 50, 7, 7])
    q, k = torch.randn(T, 4, head_dim), torch.randn(T, 2, head_dim)
    cache = _cos_sin_cache(128, rot_dim)
    q_out, k_out = reference.rotary_embedding(positions, q, k, cache, is_neox)
    torch.testing.assert_close(q_out, _rotate_complex(q, positions, rot_dim, 10000.0, is_neox), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(k_out, _rotate_complex(k, positions, rot_dim, 10000.0, is_neox), atol=1e-5, rtol=1e-5)
    assert torch.equal(q_out[..., rot_dim:], q[..., rot_dim:])


def test_silu_and_mul():
    x = torch.randn(4, 10)
    torch.testing.assert_close(reference.silu_and_mul(x), F.silu(x[:, :5]) * x[:, 5:])
