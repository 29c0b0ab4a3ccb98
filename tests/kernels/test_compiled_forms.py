"""The attention kernels compile once per model, not once per step shape (CUDA only).

Serving changes the block-table width, the row a slice starts at, the query lengths and the context
split count every step; a Triton argument specialized on its value or its 16-byte alignment compiles a
new form when that changes, and a compile (0.2-0.5 s) mid-serving stalls every request in flight (seen
on an H200: a third of the worker's time at c=128). The forms are counted in Triton's per-device cache.
"""

from __future__ import annotations

import pytest
import torch
from aserve.kernels import paged_decode_attention as decode_module
from aserve.kernels import paged_prefill_attention as prefill_module

pytestmark = pytest.mark.gpu


def compiled_forms(kernel, device: torch.device) -> int:
    """How many compiled forms of a `@triton.jit` kernel exist for `device` (Triton's per-device cache)."""
    caches = kernel.device_caches
    index = torch.cuda.current_device() if device.index is None else device.index
    return len(caches[index][0]) if index in caches else 0


def _widened(table: torch.Tensor, width: int) -> torch.Tensor:
    out = torch.zeros(table.shape[0], width, dtype=table.dtype, device=table.device)
    out[:, : table.shape[1]] = table
    return out


def test_decode_compiles_once_per_split_mode(paged_case, gen):
    device = torch.device("cuda")
    case = paged_case([700, 33, 1, 300, 90], 16, 2, 128, torch.bfloat16, device, gen)
    q = torch.randn(5, 8, 128, generator=gen).to(torch.bfloat16).to(device)
    decode, reduce = decode_module._paged_decode_kernel, decode_module._reduce_splits_kernel
    for splits in (1, 2):  # the two modes: a single pass, and split context + reduction
        decode_module.paged_decode_attention(q, case.kv_cache, case.block_tables, case.seq_lens, 0.1,
                                             num_splits=splits)
    before = compiled_forms(decode, device), compiled_forms(reduce, device)
    base = case.block_tables.shape[1]
    for width in (base, base + 1, 48, 64, 65):
        table = _widened(case.block_tables, width)
        for first in (0, 1, 3):  # slices starting at any row (the decode rows of a mixed batch)
            for splits in (1, 3, 5, 17, 32):
                got = decode_module.paged_decode_attention(
                    q[first:], case.kv_cache, table[first:], case.seq_lens[first:], 0.1, num_splits=splits)
                assert got.shape == q[first:].shape
    torch.cuda.synchronize()
    assert (compiled_forms(decode, device), compiled_forms(reduce, device)) == before


def test_prefill_compiles_once_for_any_query_length(paged_case, gen):
    device = torch.device("cuda")
    q_lens, cached = [1, 5, 17, 40, 130], [0, 60, 3, 200, 0]
    case = paged_case([a + b for a, b in zip(q_lens, cached)], 16, 2, 128, torch.bfloat16, device, gen)
    starts = [0]
    for n in q_lens:
        starts.append(starts[-1] + n)
    q = torch.randn(starts[-1], 8, 128, generator=gen).to(torch.bfloat16).to(device)
    qsl = torch.tensor(starts, dtype=torch.int32, device=device)
    kernel = prefill_module._paged_prefill_kernel
    prefill_module.paged_prefill_attention(q, case.kv_cache, case.block_tables, qsl, case.seq_lens, 0.1,
                                           query_start_loc_cpu=starts)
    before = compiled_forms(kernel, device)
    base = case.block_tables.shape[1]
    for width in (base + 1, 32, 33):
        table = _widened(case.block_tables, width)
        for first in range(len(q_lens)):  # every suffix: max query lengths 130, 40, 17, 5 ... and odd row starts
            sub = [s - starts[first] for s in starts[first:]]
            got = prefill_module.paged_prefill_attention(
                q[starts[first]:], case.kv_cache, table[first:], qsl[first:] - starts[first], case.seq_lens[first:],
                0.1, query_start_loc_cpu=sub)
            assert got.shape == q[starts[first]:].shape
    torch.cuda.synchronize()
    assert compiled_forms(kernel, device) == before
