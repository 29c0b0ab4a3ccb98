"""TritonAttentionBackend against TorchAttentionBackend on the same metadata (fp32, interpreter on CPU).

Mirrors aserve/model/attention/triton_backend.py; this folder's conftest sets TRITON_INTERPRET when
there is no GPU and provides the `device` and `gen` fixtures.
"""

from __future__ import annotations

import pytest
import torch

from aserve.model.attention.base import AttentionMetadata
from aserve.model.attention.torch_backend import TorchAttentionBackend
from aserve.model.attention.triton_backend import TritonAttentionBackend

NUM_HEADS, NUM_KV_HEADS, HEAD_DIM = 4, 2, 64

# (cached tokens, new tokens) per sequence; decodes (1 new token) first, as the runner orders them.
BATCHES = {
    "mixed": [(12, 1), (29, 1), (0, 6), (16, 5)],
    "decode-only": [(3, 1), (40, 1)],
    "prefill-only": [(0, 9), (8, 3)],
}


def _step(batch, block_size, device, gen, *, num_padding=0, cache_dtype=torch.float32,
          scale=1.0):  # fmt: skip
    """A KV cache holding each sequence's cached tokens, this step's q/k/v and its metadata."""
    seq_lens = [c + n for c, n in batch]
    q_lens = [n for _, n in batch]
    blocks = [-(-s // block_size) for s in seq_lens]
    num_blocks = sum(blocks) + 3
    order = torch.randperm(num_blocks, generator=gen).tolist()
    table = torch.zeros(len(batch), max(blocks) + 2, dtype=torch.int32)
    slots, used = [], 0
    for i, ((cached, new), nb) in enumerate(zip(batch, blocks)):
        table[i, :nb] = torch.tensor(order[used : used + nb])
        used += nb
        slots += [
            int(table[i, p // block_size]) * block_size + p % block_size for p in range(cached, cached + new)
        ]
    num_tokens = len(slots)
    cache = torch.randn(2, num_blocks, block_size, NUM_KV_HEADS, HEAD_DIM, generator=gen)
    total = num_tokens + num_padding
    q = torch.randn(total, NUM_HEADS, HEAD_DIM, generator=gen)
    k = torch.randn(total, NUM_KV_HEADS, HEAD_DIM, generator=gen)
    v = torch.randn(total, NUM_KV_HEADS, HEAD_DIM, generator=gen)
    if cache_dtype != torch.float32:
        # fp8: pre-quantized values, so the interpreter's fp32->fp8 rounding never matters.
        cache = cache.to(cache_dtype)
        k = k.to(cache_dtype).float() * scale
        v = v.to(cache_dtype).float() * scale
    starts = [0]
    for n in q_lens:
        starts.append(starts[-1] + n)
    num_decodes = next((i for i, n in enumerate(q_lens) if n != 1), len(q_lens))
    meta = AttentionMetadata(
        num_tokens=num_tokens,
        num_seqs=len(batch),
        num_decodes=num_decodes,
        num_decode_tokens=num_decodes,
        slot_mapping=torch.tensor(slots + [-1] * num_padding, dtype=torch.int64, device=device),
        query_start_loc=torch.tensor(starts, dtype=torch.int32, device=device),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=device),
        block_tables=table.to(device),
        max_query_len=max(q_lens),
        max_seq_len=max(seq_lens),
        query_start_loc_cpu=starts,
        seq_lens_cpu=seq_lens,
    )
    return cache.to(device), q.to(device), k.to(device), v.to(device), meta


def _both(cache, q, k, v, meta, sliding_window=None, softcap=None, kv_scales=(1.0, 1.0)):
    torch_cache, triton_cache = cache.clone(), cache.clone()
    want = TorchAttentionBackend().forward(q, k, v, torch_cache, meta, HEAD_DIM**-0.5, sliding_window, softcap,
                                           *kv_scales)
    got = TritonAttentionBackend().forward(q, k, v, triton_cache, meta, HEAD_DIM**-0.5, sliding_window, softcap,
                                           *kv_scales)
    assert torch.equal(triton_cache.view(torch.uint8), torch_cache.view(torch.uint8))
    return got, want


@pytest.mark.parametrize("kind", list(BATCHES))
@pytest.mark.parametrize("block_size", [8, 16])
def test_matches_torch_backend(device, gen, kind, block_size):
    cache, q, k, v, meta = _step(BATCHES[kind], block_size, device, gen)
    got, want = _both(cache, q, k, v, meta)
    assert got.shape == q.shape
    torch.testing.assert_close(got, want, atol=2e-5, rtol=2e-5)


def test_padded_batch_and_sliding_window(device, gen):
    cache, q, k, v, meta = _step(BATCHES["mixed"], 8, device, gen, num_padding=3)
    got, want = _both(cache, q, k, v, meta, sliding_window=5)
    torch.testing.assert_close(got, want, atol=2e-5, rtol=2e-5)
    assert torch.all(got[meta.num_tokens :] == 0)


@pytest.mark.parametrize("softcap", [0.5, 3.0])
def test_logit_softcap_with_a_window(device, gen, softcap):
    """Gemma 2's capped scores (the small cap changes the distribution a lot) in decode and prefill."""
    cache, q, k, v, meta = _step(BATCHES["mixed"], 8, device, gen)
    q = q * 8  # scores well past the cap
    got, want = _both(cache, q, k, v, meta, sliding_window=5, softcap=softcap)
    torch.testing.assert_close(got, want, atol=2e-5, rtol=2e-5)
    uncapped, _ = _both(cache, q, k, v, meta, sliding_window=5)
    assert not torch.allclose(got, uncapped, atol=1e-3)


@pytest.mark.parametrize("cache_dtype", [torch.float8_e4m3fn, torch.float8_e5m2], ids=["e4m3", "e5m2"])
def test_fp8_cache(device, gen, cache_dtype):
    cache, q, k, v, meta = _step(BATCHES["mixed"], 16, device, gen, cache_dtype=cache_dtype, scale=0.5)
    got, want = _both(cache, q, k, v, meta, kv_scales=(0.5, 0.5))
    torch.testing.assert_close(got, want, atol=2e-5, rtol=2e-5)


def test_name():
    assert TritonAttentionBackend.name == "triton"
