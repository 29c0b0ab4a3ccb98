"""Kernel tests: CUDA tensors when a GPU is present, else CPU tensors through Triton's interpreter.

The kernel wrappers run CPU tensors through the interpreter whatever TRITON_INTERPRET was when
triton was imported (see aserve/kernels/triton_utils.py); setting it here too, only when there
is no GPU, makes any other jit'd function decorated later interpreted as well.
"""

from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

FP8_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)


@pytest.fixture
def device() -> torch.device:
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


@pytest.fixture
def gen() -> torch.Generator:
    return torch.Generator().manual_seed(1234)


class PagedCase:
    """Sequences laid out in a paged KV cache with scattered blocks and garbage in unused slots.

    `kv_cache` [2, num_blocks, block_size, KVH, D]; `block_tables` [S, max_blocks + 1] int32 (one
    spare padding column of 0s); `seq_lens` [S] int32. Unused slots hold large values, so a
    kernel that reads past a sequence's end (or through padding) gets a visibly wrong answer.
    """

    def __init__(self, seq_lens, block_size, num_kv_heads, head_dim, dtype, device, gen, *, scale=1.0):
        blocks_per_seq = [-(-n // block_size) for n in seq_lens]
        num_blocks = sum(blocks_per_seq) + 2
        order = torch.randperm(num_blocks, generator=gen)
        max_blocks = max(blocks_per_seq) + 1
        table = torch.zeros(len(seq_lens), max_blocks, dtype=torch.int32)
        used = 0
        for i, nb in enumerate(blocks_per_seq):
            table[i, :nb] = order[used : used + nb].to(torch.int32)
            used += nb
        shape = (2, num_blocks, block_size, num_kv_heads, head_dim)
        values = torch.randn(shape, generator=gen)
        garbage = 50.0 * torch.randn(shape, generator=gen).abs() + 20.0
        live = torch.zeros(num_blocks, block_size, dtype=torch.bool)
        for i, n in enumerate(seq_lens):
            t = torch.arange(n)
            live[table[i, t // block_size].long(), t % block_size] = True
        data = torch.where(live[None, :, :, None, None], values, garbage)
        if dtype in FP8_DTYPES:
            data = (data / scale).to(dtype)  # torch's own (correct) rounding; the kernels only read it
        else:
            data = data.to(dtype)
        self.kv_cache = data.to(device)
        self.block_tables = table.to(device)
        self.seq_lens = torch.tensor(seq_lens, dtype=torch.int32, device=device)
        self.seq_lens_cpu = list(seq_lens)


@pytest.fixture
def paged_case():
    """Factory: paged_case(seq_lens, block_size, num_kv_heads, head_dim, dtype, device, gen, scale=1.0)."""
    return PagedCase
