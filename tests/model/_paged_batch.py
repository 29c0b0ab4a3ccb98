"""Test helper: a hand-built paged KV cache and per-step AttentionMetadata (what the runner does), and
the naive dense attention the paged paths are compared with.

Blocks come from a shuffled free list, so block tables are non-contiguous; block tables are padded
wider than needed (with 0) to check that backends only read what `seq_lens` covers.
"""

from __future__ import annotations

import random

import torch

from aserve.model.attention.base import AttentionMetadata


class PagedBatch:
    """Owns per-layer KV caches and per-sequence block tables; `step()` builds one batch."""

    def __init__(self, num_layers: int, num_kv_heads: int, head_dim: int, block_size: int, num_blocks: int,
                 dtype: torch.dtype = torch.float32, seed: int = 0):
        self.block_size = block_size
        self.kv_caches = [torch.zeros(2, num_blocks, block_size, num_kv_heads, head_dim, dtype=dtype)
                          for _ in range(num_layers)]
        self.free_blocks = list(range(num_blocks))
        random.Random(seed).shuffle(self.free_blocks)
        self.block_tables: dict[int, list[int]] = {}
        self.num_computed: dict[int, int] = {}

    def step(self, chunks: list[tuple[int, list[int]]]) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata]:
        """`chunks`: (seq id, new token ids) in batch order, query-length-1 sequences first.

        Returns (input_ids [T], positions [T], meta) and advances each sequence's computed count.
        """
        num_decodes = 0
        while num_decodes < len(chunks) and len(chunks[num_decodes][1]) == 1:
            num_decodes += 1
        assert all(len(tokens) > 1 for _, tokens in chunks[num_decodes:]), "decodes must come first"
        input_ids, positions, slots, starts, seq_lens = [], [], [], [0], []
        for seq_id, tokens in chunks:
            start = self.num_computed.get(seq_id, 0)
            end = start + len(tokens)
            table = self.block_tables.setdefault(seq_id, [])
            while len(table) * self.block_size < end:
                table.append(self.free_blocks.pop())
            for pos in range(start, end):
                slots.append(table[pos // self.block_size] * self.block_size + pos % self.block_size)
            input_ids += tokens
            positions += range(start, end)
            starts.append(starts[-1] + len(tokens))
            seq_lens.append(end)
            self.num_computed[seq_id] = end
        width = max(len(self.block_tables[s]) for s, _ in chunks) + 2
        tables = [self.block_tables[s] + [0] * (width - len(self.block_tables[s])) for s, _ in chunks]
        meta = AttentionMetadata(
            num_tokens=len(input_ids),
            num_seqs=len(chunks),
            num_decodes=num_decodes,
            num_decode_tokens=num_decodes,
            slot_mapping=torch.tensor(slots, dtype=torch.int64),
            query_start_loc=torch.tensor(starts, dtype=torch.int32),
            seq_lens=torch.tensor(seq_lens, dtype=torch.int32),
            block_tables=torch.tensor(tables, dtype=torch.int32),
            max_query_len=max(len(t) for _, t in chunks),
            max_seq_len=max(seq_lens),
            query_start_loc_cpu=starts,
            seq_lens_cpu=seq_lens,
        )
        return (torch.tensor(input_ids, dtype=torch.int64), torch.tensor(positions, dtype=torch.int64), meta)


def naive_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_positions: torch.Tensor, scale: float,
                    sliding_window: int | None = None) -> torch.Tensor:
    """q [Q, H, D] at absolute `q_positions`; k/v [L, KVH, D] at positions 0..L-1. fp32 math."""
    group = q.shape[1] // k.shape[1]
    k = k.float().repeat_interleave(group, dim=1)
    v = v.float().repeat_interleave(group, dim=1)
    scores = torch.einsum("qhd,khd->hqk", q.float(), k) * scale
    k_pos = torch.arange(k.shape[0])
    allowed = k_pos[None, :] <= q_positions[:, None]
    if sliding_window is not None:
        allowed &= k_pos[None, :] > q_positions[:, None] - sliding_window
    scores = scores.masked_fill(~allowed[None], float("-inf"))
    return torch.einsum("hqk,khd->qhd", scores.softmax(-1), v)
