"""TorchAttentionBackend: a mixed decode + prefill/extend batch over a paged cache equals dense attention."""

from __future__ import annotations

import pytest
import torch

from aserve.model.attention.base import AttentionMetadata
from aserve.model.attention.torch_backend import TorchAttentionBackend
from tests.model._paged_batch import naive_attention


def _step(block_size, num_kv_heads, head_dim, contexts, q_lens, num_pad=0, seed=0,
          layout_seed=0):
    """Random cached context per sequence (already in the cache) plus this step's new tokens.

    The block layout depends only on `layout_seed` (layers of one model share block tables)."""
    gen = torch.Generator().manual_seed(seed)
    seq_lens = [c + q for c, q in zip(contexts, q_lens, strict=True)]
    num_blocks = sum(-(-n // block_size) for n in seq_lens) + 4
    perm = torch.randperm(num_blocks, generator=torch.Generator().manual_seed(layout_seed)).tolist()
    cache = torch.zeros(2, num_blocks, block_size, num_kv_heads, head_dim)
    tables, slots, full_k, full_v, new_k, new_v = [], [], [], [], [], []
    for ctx, n in zip(contexts, seq_lens, strict=True):
        nb = -(-n // block_size)
        blocks, perm = perm[:nb], perm[nb:]
        tables.append(blocks)
        k = torch.randn(n, num_kv_heads, head_dim, generator=gen)
        v = torch.randn(n, num_kv_heads, head_dim, generator=gen)
        full_k.append(k)
        full_v.append(v)
        for pos in range(n):
            b, off = blocks[pos // block_size], pos % block_size
            if pos < ctx:  # cached context, written by earlier steps
                cache[0, b, off], cache[1, b, off] = k[pos], v[pos]
            else:
                slots.append(b * block_size + off)
        new_k.append(k[ctx:])
        new_v.append(v[ctx:])
    width = max(len(t) for t in tables) + 3
    starts = [0]
    for q in q_lens:
        starts.append(starts[-1] + q)
    num_tokens = starts[-1]
    meta = AttentionMetadata(
        num_tokens=num_tokens, num_seqs=len(q_lens), num_decodes=sum(1 for q in q_lens if q == 1),
        num_decode_tokens=sum(1 for q in q_lens if q == 1),
        slot_mapping=torch.tensor(slots + [-1] * num_pad, dtype=torch.int64),
        query_start_loc=torch.tensor(starts, dtype=torch.int32),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32),
        block_tables=torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int32),
        max_query_len=max(q_lens), max_seq_len=max(seq_lens),
        query_start_loc_cpu=starts, seq_lens_cpu=seq_lens,
    )
    k = torch.cat(new_k + [torch.randn(num_pad, num_kv_heads, head_dim)])
    v = torch.cat(new_v + [torch.randn(num_pad, num_kv_heads, head_dim)])
    return cache, meta, k, v, full_k, full_v


def _check(q_lens, contexts, block_size=16, num_heads=6, num_kv_heads=2, num_pad=0, sliding_window=None,
           dtype=torch.float32, backend=None, head_dim=16):
    cache, meta, k, v, full_k, full_v = _step(block_size, num_kv_heads, head_dim, contexts, q_lens, num_pad,
                                              seed=block_size)
    q = torch.randn(meta.num_tokens + num_pad, num_heads, head_dim)
    if dtype != torch.float32:  # the reference sees the same rounded values
        cache, q, k, v = (t.to(dtype) for t in (cache, q, k, v))
        full_k, full_v = [t.to(dtype).float() for t in full_k], [t.to(dtype).float() for t in full_v]
    tolerance = {"atol": 1e-5, "rtol": 1e-5} if dtype == torch.float32 else {"atol": 2e-2, "rtol": 2e-2}
    before = cache.clone()
    out = (backend or TorchAttentionBackend()).forward(q, k, v, cache, meta, scale=0.25, sliding_window=sliding_window)
    assert out.shape == q.shape and out.dtype == dtype
    starts = meta.query_start_loc_cpu
    for i, n in enumerate(meta.seq_lens_cpu):
        q_pos = torch.arange(n - q_lens[i], n)
        want = naive_attention(q[starts[i]:starts[i + 1]].float(), full_k[i], full_v[i], q_pos, 0.25, sliding_window)
        torch.testing.assert_close(out[starts[i]:starts[i + 1]].float(), want, **tolerance)
    if num_pad:
        assert out[meta.num_tokens:].abs().sum() == 0
    changed = (cache != before).flatten(3).any(-1)  # [2, blocks, block_size]
    assert changed.sum() == 2 * meta.num_tokens  # exactly this step's slots were written


def test_mixed_decode_and_prefill_batch():
    # decodes first (query length 1 over cached context), then an extend and two fresh prefills
    _check(q_lens=[1, 1, 1, 9, 20, 5], contexts=[40, 3, 16, 23, 0, 0])


def test_decode_only_and_prefill_only_batches():
    _check(q_lens=[1, 1, 1, 1], contexts=[0, 70, 31, 8], block_size=8)
    _check(q_lens=[12, 33], contexts=[0, 17], block_size=32)


def test_padded_batch_leaves_padding_rows_zero():
    _check(q_lens=[1, 1, 7], contexts=[10, 5, 0], num_pad=5)


def test_sliding_window_in_decode_and_extend():
    _check(q_lens=[1, 1, 6, 30], contexts=[40, 3, 20, 0], sliding_window=7, block_size=8)


@pytest.mark.parametrize("c_kernel", [True, False])
@pytest.mark.parametrize("case", [
    {"q_lens": [1, 1, 1, 9, 20, 5], "contexts": [40, 3, 16, 23, 0, 0]},  # decodes attend in the kernel
    {"q_lens": [1, 1, 1, 1], "contexts": [0, 70, 31, 8], "block_size": 8},  # the kernel also writes K/V
    {"q_lens": [1, 1, 7], "contexts": [10, 5, 0], "num_pad": 5},
    {"q_lens": [1, 1, 6, 30], "contexts": [40, 3, 20, 0], "sliding_window": 7, "block_size": 8},
])
def test_bf16_cache_with_and_without_the_c_decode_kernel(case, c_kernel):
    backend = TorchAttentionBackend()
    if c_kernel and backend._kernels is None:
        pytest.skip("the C kernels cannot be built here")
    if not c_kernel:
        backend._kernels = None
    _check(**case, dtype=torch.bfloat16, backend=backend)


@pytest.mark.parametrize("case", [
    {"q_lens": [1, 1, 1, 9, 20, 5], "contexts": [40, 3, 16, 23, 0, 0]},
    {"q_lens": [1, 1, 7], "contexts": [10, 5, 0], "num_pad": 5},
    {"q_lens": [1, 1, 6, 30], "contexts": [40, 3, 20, 0], "sliding_window": 7, "block_size": 8},
])
def test_bf16_prefills_attend_in_the_c_prefill_kernel(case, monkeypatch):
    backend = TorchAttentionBackend()
    if backend._kernels is None or not backend._kernels.native_bf16_dot:
        pytest.skip("no C kernels with the bf16 dot product here")
    kernel, calls = backend._kernels.paged_prefill_attention, []

    def counted(*args, **kwargs):
        calls.append(kernel(*args, **kwargs))
        return calls[-1]

    monkeypatch.setattr(backend._kernels, "paged_prefill_attention", counted)  # the shared, cached kernels
    _check(**case, dtype=torch.bfloat16, backend=backend, head_dim=32)  # head size 32: the kernel takes it
    assert calls == [True]


def test_step_plan_is_shared_by_layers_and_rebuilt_for_each_forward():
    backend = TorchAttentionBackend()
    for step_seed, (q_lens, contexts) in enumerate([([1, 1, 12], [30, 4, 0]), ([1, 5], [9, 40])]):
        caches = []
        for layer in range(2):  # two layers over the same metadata, each with its own cache
            cache, meta, k, v, full_k, full_v = _step(16, 2, 16, contexts, q_lens, seed=10 * step_seed + layer,
                                                      layout_seed=step_seed)
            caches.append((cache, meta, k, v, full_k, full_v))
        meta = caches[0][1]
        backend.begin_forward(meta)
        for cache, _, k, v, full_k, full_v in caches:
            q = torch.randn(meta.num_tokens, 4, 16)
            out = backend.forward(q, k, v, cache, meta, scale=0.25)
            for i, n in enumerate(meta.seq_lens_cpu):
                s, e = meta.query_start_loc_cpu[i], meta.query_start_loc_cpu[i + 1]
                want = naive_attention(q[s:e], full_k[i], full_v[i], torch.arange(n - q_lens[i], n), 0.25)
                torch.testing.assert_close(out[s:e], want, atol=1e-5, rtol=1e-5)


def test_skipped_slots_in_the_middle_are_not_written():
    cache, meta, k, v, _, _ = _step(8, 2, 16, [5, 0], [1, 6], seed=3)
    meta.slot_mapping = meta.slot_mapping.clone()
    meta.slot_mapping[3] = -1  # e.g. a token whose K/V another request already holds
    q = torch.randn(meta.num_tokens, 4, 16)
    before = cache.clone()
    TorchAttentionBackend().forward(q, k, v, cache, meta, scale=0.25)
    changed = (cache != before).flatten(3).any(-1).sum().item()
    assert changed == 2 * (meta.num_tokens - 1)


def test_fp8_cache_matches_the_reference_functions():
    from aserve.kernels import reference

    q_lens, contexts = [1, 1, 9], [20, 7, 11]
    cache32, meta, k, v, _, _ = _step(16, 2, 16, contexts, q_lens, seed=5)
    cache = (cache32 / torch.tensor([0.5, 1.5]).view(2, 1, 1, 1, 1)).to(torch.float8_e4m3fn)
    q = torch.randn(meta.num_tokens, 4, 16)
    out = TorchAttentionBackend().forward(q, k, v, cache, meta, scale=0.25, k_scale=0.5, v_scale=1.5)
    decode = reference.paged_decode_attention(q[:2], cache, meta.block_tables[:2], meta.seq_lens[:2], 0.25,
                                              k_scale=0.5, v_scale=1.5)
    prefill = reference.paged_prefill_attention(
        q[2:], cache, meta.block_tables[2:], meta.query_start_loc[2:] - 2, meta.seq_lens[2:], 0.25,
        k_scale=0.5, v_scale=1.5)
    torch.testing.assert_close(out, torch.cat([decode, prefill]), atol=1e-6, rtol=1e-6)
