"""The C prefill / extend attention (`aserve/kernels/cpu_prefill_attention.c`) against aserve's fp32
reference (`reference.attend_prefill` over each sequence's gathered keys and values).

The kernel rounds the probabilities to bf16 before p.V (as torch's flash attention does), so results
agree with the fp32 reference to bf16 precision, not to one rounding.
"""

from __future__ import annotations

import platform
import shutil
import subprocess

import pytest
import torch

from aserve.kernels import cpu_ops, reference

BF16 = torch.bfloat16

pytestmark = pytest.mark.skipif(shutil.which("cc") is None, reason="no C compiler")


@pytest.fixture(scope="module")
def kernels() -> cpu_ops.CpuKernels:
    built = cpu_ops.build("native")
    if not built.native_bf16_dot:
        pytest.skip("this CPU has no AVX512-BF16: the kernel declines (see the x86-64-v3 test)")
    return built


def _rand(*shape: int, seed: int, scale: float = 1.0) -> torch.Tensor:
    return (torch.randn(*shape, generator=torch.Generator().manual_seed(seed)) * scale).to(BF16)


def _batch(query_lens, seq_lens, heads, kv_heads, head_dim, block_size=16, seed=0):
    """A flat batch: q rows of every sequence in turn, block tables over a shuffled cache."""
    blocks_per_seq = max(-(-n // block_size) for n in seq_lens)
    num_blocks = blocks_per_seq * len(seq_lens) + 3
    cache = _rand(2, num_blocks, block_size, kv_heads, head_dim, seed=seed)
    perm = torch.randperm(num_blocks, generator=torch.Generator().manual_seed(seed + 1))
    tables = perm[:blocks_per_seq * len(seq_lens)].view(len(seq_lens), blocks_per_seq).to(torch.int32)
    starts = torch.tensor([0, *torch.tensor(query_lens).cumsum(0).tolist()], dtype=torch.int32)
    q = _rand(int(starts[-1]), heads, head_dim, seed=seed + 2, scale=2.0)
    return q, cache, tables, torch.tensor(seq_lens, dtype=torch.int32), starts


def _reference(q, cache, tables, seq_lens, starts, first, scale, window=None, softcap=None):
    block_size, kv_heads, head_dim = cache.shape[2:]
    want = {}
    for s in range(first, len(seq_lens)):
        q0, q1, length = int(starts[s]), int(starts[s + 1]), int(seq_lens[s])
        if q1 == q0:
            continue
        blocks = tables[s, : -(-length // block_size)].long()
        keys, values = (cache[i][blocks].reshape(-1, kv_heads, head_dim)[:length].float() for i in (0, 1))
        mask = reference.prefill_mask(q1 - q0, length, window, q.device)
        want[(q0, q1)] = reference.attend_prefill(q[q0:q1].float(), keys, values, mask, scale, softcap)
    return want


# 20 query heads a KV head: 3 tokens a work item; head size 256: the largest buffers
@pytest.mark.parametrize("heads,kv_heads,head_dim", [(9, 3, 64), (4, 4, 128), (16, 1, 32), (8, 2, 96), (20, 1, 64),
                                                    (4, 2, 256)])
@pytest.mark.parametrize("window", [None, 21])
@pytest.mark.parametrize("block_size", [16, 5])
def test_prefills_and_extends_match_the_reference(kernels, heads, kv_heads, head_dim, window, block_size):
    # a whole prompt, an extend (chunked prefill / prefix hit), one query token, an empty row, past 32 keys
    query_lens, seq_lens = [70, 9, 1, 0, 33], [70, 50, 17, 5, 100]
    q, cache, tables, lens, starts = _batch(query_lens, seq_lens, heads, kv_heads, head_dim, block_size)
    out = torch.full_like(q, 7.0)
    scale = head_dim**-0.5
    assert kernels.paged_prefill_attention(q, cache, tables, lens, starts, (0, 5), out, scale, window)
    for (q0, q1), want in _reference(q, cache, tables, lens, starts, 0, scale, window).items():
        torch.testing.assert_close(out[q0:q1].float(), want, atol=2e-2, rtol=2e-2)


def test_only_the_named_sequences_are_written_and_q_may_be_strided(kernels):
    query_lens, seq_lens = [1, 1, 40], [30, 12, 40]  # two decodes first, as the scheduler orders them
    q_packed, cache, tables, lens, starts = _batch(query_lens, seq_lens, 6, 2, 64, seed=5)
    qkv = torch.cat([q_packed.flatten(1), _rand(q_packed.shape[0], 2 * 2 * 64, seed=6)], dim=1)
    q = qkv[:, :6 * 64].view(-1, 6, 64)  # a view of a fused projection: token stride > H * D
    out = torch.full_like(q_packed, 7.0)
    assert kernels.paged_prefill_attention(q, cache, tables, lens, starts, (2, 3), out, 0.125)
    assert bool((out[:2] == 7.0).all())  # the decode rows are the caller's
    want = _reference(q_packed, cache, tables, lens, starts, 2, 0.125)[(2, 42)]
    torch.testing.assert_close(out[2:].float(), want, atol=2e-2, rtol=2e-2)


@pytest.mark.parametrize("softcap", [0.5, 5.0])
def test_a_logit_softcap_caps_the_scores(kernels, softcap):
    q, cache, tables, lens, starts = _batch([48], [60], 4, 2, 64, seed=9)
    out = torch.empty_like(q)
    assert kernels.paged_prefill_attention(q, cache, tables, lens, starts, (0, 1), out, 0.5, 13, softcap)
    want = _reference(q, cache, tables, lens, starts, 0, 0.5, 13, softcap)[(0, 48)]
    torch.testing.assert_close(out.float(), want, atol=2e-2, rtol=2e-2)
    uncapped = _reference(q, cache, tables, lens, starts, 0, 0.5, 13)[(0, 48)]
    assert not torch.allclose(want, uncapped, atol=5e-2)


def test_it_declines_what_it_does_not_cover(kernels):
    q, cache, tables, lens, starts = _batch([5], [5], 4, 2, 40)  # head size 40: not a multiple of 32
    out = torch.full_like(q, 7.0)
    assert not kernels.paged_prefill_attention(q, cache, tables, lens, starts, (0, 1), out, 0.2)
    assert bool((out == 7.0).all())
    q, cache, tables, lens, starts = _batch([5], [5], 65, 1, 32)  # 65 query heads a KV head: past one item
    assert not kernels.paged_prefill_attention(q, cache, tables, lens, starts, (0, 1), torch.empty_like(q), 0.2)
    with pytest.raises(ValueError, match="paged_prefill_attention"):
        kernels.paged_prefill_attention(q, cache, tables, lens.long(), starts, (0, 1), out, 0.2)
    with pytest.raises(ValueError, match="paged_prefill_attention"):  # query rows past the end of q
        kernels.paged_prefill_attention(q, cache, tables, lens, starts + 1, (0, 1), torch.empty_like(q), 0.2)


@pytest.mark.skipif(platform.machine() not in ("x86_64", "AMD64"), reason="x86 builds")
def test_without_avx512_bf16_it_declines():
    try:
        portable = cpu_ops.build("x86-64-v3")
    except (OSError, subprocess.CalledProcessError) as e:
        pytest.skip(f"cannot build for x86-64-v3: {e}")
    q, cache, tables, lens, starts = _batch([5], [5], 4, 2, 64)
    assert not portable.paged_prefill_attention(q, cache, tables, lens, starts, (0, 1), torch.empty_like(q), 0.2)
