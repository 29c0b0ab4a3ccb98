"""The attention-backend interface: how a layer reads and writes the paged KV cache.

KV cache layout, per layer: one tensor `[2, num_blocks, block_size, num_kv_heads, head_dim]`
(index 0 = keys, 1 = values). Token t of a sequence lives in block `block_table[t // block_size]`
at offset `t % block_size`; its flat slot is `block_id * block_size + offset`.

The runner orders each batch with decode sequences (query length 1) first, then prefill /
extend sequences (query length >= 1 that attend to cached context plus themselves, causally).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch


@dataclass
class AttentionMetadata:
    """Per-step inputs shared by every attention layer. Tensors live on the model's device."""

    num_tokens: int  # real (unpadded) tokens in the flat batch
    num_seqs: int
    num_decodes: int  # the first `num_decodes` sequences have query length 1
    num_decode_tokens: int  # == num_decodes
    slot_mapping: torch.Tensor  # [num_tokens] int64: where each new token's K/V is written (-1: skip)
    query_start_loc: torch.Tensor  # [num_seqs + 1] int32: cumulative query lengths
    seq_lens: torch.Tensor  # [num_seqs] int32: context length after this step (cached + new)
    block_tables: torch.Tensor  # [num_seqs, max_blocks_per_seq] int32 (padded with 0)
    max_query_len: int
    max_seq_len: int
    # Host copies, so CPU code can loop over prefill sequences without device syncs.
    query_start_loc_cpu: list[int]
    seq_lens_cpu: list[int]
    # (fp8 KV caches: each attention layer passes its own k_scale / v_scale to the backend; see
    # aserve/model/kv_scales.py)


@dataclass(frozen=True)
class DecodeInputs:
    """A decode-only step's attention inputs as tensors alone, which a compiled forward takes in place
    of `AttentionMetadata` (its graph then depends on none of their values; see runner/compiled_decode.py).
    Only backends with `supports_decode_inputs` accept it."""

    slots: torch.Tensor  # [B] int64: where each sequence's new K/V goes (no -1)
    block_ids: torch.Tensor  # [B * blocks_per_seq] int64: the blocks to read, sequence by sequence
    mask: torch.Tensor  # [B, blocks_per_seq * block_size] bool; empty: one sequence, no mask needed
    decode_len: torch.Tensor  # 0-d int64: keys to read when `mask` is empty
    # Flat scratch for the gathered keys / values (cache dtype), at least
    # `block_ids.numel() * block_size * KVH * D` elements each, reused step after step.
    key_buffer: torch.Tensor
    value_buffer: torch.Tensor
    # (no KV scales: the calling layer passes its own to `forward`, so a compiled graph holds each layer's)


class AttentionBackend(Protocol):
    """Writes this step's K/V into the cache, then attends. Shapes: q [T, H, D], k/v [T, KVH, D].

    `sliding_window` is the calling layer's own (None: full attention): a key at position p is seen
    by a query at position q when q - window < p <= q. Layers of one model may use different windows
    in the same step; a backend may plan once per (step, window). `logit_softcap` (the layer's, or
    None) caps the scores: `softcap * tanh(scores / softcap)` before the softmax. `k_scale` / `v_scale`
    are the calling layer's fp8 KV-cache scales (1.0 when the cache is not fp8): K/V are stored as
    `fp8(k / k_scale)`, `fp8(v / v_scale)` and multiplied back when read."""

    name: str

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        kv_cache: torch.Tensor,
        meta: AttentionMetadata,
        scale: float,
        sliding_window: int | None = None,
        logit_softcap: float | None = None,
        k_scale: float = 1.0,
        v_scale: float = 1.0,
    ) -> torch.Tensor:  # [T, H, D]
        ...
