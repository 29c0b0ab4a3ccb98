"""Bidirectional (encoder) attention over a packed batch of whole sequences: no causal mask, no KV
cache. Used by encoder-only pooling models (BERT, aserve/model/models/bert.py).

Contract: a step packs `num_seqs` complete sequences back to back into `T` token rows; sequence i owns
rows `[query_start_loc[i], query_start_loc[i + 1])`, and each of its tokens attends to every token of
its own sequence and to none of any other. Encoders see each sequence whole in one step (no chunked
prefill: there is no cache to carry a chunk's keys to the next step).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch
import torch.nn.functional as F


@dataclass(frozen=True)
class EncoderMetadata:
    """One encoder step's packing. Tensors live on the model's device; `seq_lens_cpu` is the host copy
    (shapes are planned from it, never from a device sync)."""

    seq_lens_cpu: list[int]  # tokens of each sequence, in batch order (each >= 1)
    query_start_loc: torch.Tensor  # [num_seqs + 1] int32: cumulative lengths (cu_seqlens)
    # Row of each packed token in the padded [num_seqs * max_seq_len] layout (seq * max_seq_len + pos).
    padded_index: torch.Tensor  # [num_tokens] int64
    key_mask: torch.Tensor | None  # [num_seqs, 1, 1, max_seq_len] bool, True = real key; None: no padding

    @classmethod
    def from_seq_lens(cls, seq_lens: list[int], device: torch.device | str = "cpu") -> EncoderMetadata:
        """The metadata of sequences of `seq_lens` tokens packed in that order. ValueError on an empty
        batch or an empty sequence."""
        if not seq_lens or min(seq_lens) < 1:
            raise ValueError(f"an encoder step needs at least one sequence, each of >= 1 token; got {seq_lens}")
        lens = torch.tensor(seq_lens, dtype=torch.int64)
        starts = torch.zeros(len(seq_lens) + 1, dtype=torch.int64)
        starts[1:] = lens.cumsum(0)
        width = max(seq_lens)
        seq_of_token = torch.repeat_interleave(torch.arange(len(seq_lens)), lens)
        pos_in_seq = torch.arange(int(starts[-1])) - starts[:-1].repeat_interleave(lens)
        key_mask = None
        if min(seq_lens) != width:
            key_mask = (torch.arange(width)[None, :] < lens[:, None]).view(len(seq_lens), 1, 1, width).to(device)
        return cls(list(seq_lens), starts.to(device=device, dtype=torch.int32),
                   (seq_of_token * width + pos_in_seq).to(device), key_mask)

    @property
    def num_seqs(self) -> int:
        return len(self.seq_lens_cpu)

    @property
    def num_tokens(self) -> int:
        return sum(self.seq_lens_cpu)

    @property
    def max_seq_len(self) -> int:
        return max(self.seq_lens_cpu)

    def positions(self) -> torch.Tensor:
        """[num_tokens] int64: each token's position in its own sequence (0-based), on the metadata's device."""
        return self.padded_index % self.max_seq_len


class EncoderAttentionBackend(Protocol):
    """q `[T, H, D]`, k/v `[T, KVH, D]` (H a multiple of KVH) -> `[T, H, D]` in q's dtype: each token
    attends bidirectionally to the tokens of its own sequence (`EncoderMetadata`), scores scaled by
    `scale`. Nothing is cached."""

    name: str

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, meta: EncoderMetadata,
                scale: float) -> torch.Tensor:
        ...


class TorchEncoderAttentionBackend:
    """One `scaled_dot_product_attention` call for the whole batch: sequences are scattered into a
    padded `[num_seqs, H, max_seq_len, D]` layout, padded keys masked out (no mask when every sequence
    has the same length), and the real rows gathered back. Padding costs `num_seqs * max_seq_len - T`
    rows; callers batching very uneven lengths may split the step by length."""

    name = "torch-encoder"

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, meta: EncoderMetadata,
                scale: float) -> torch.Tensor:
        _, num_heads, head_dim = q.shape
        num_kv_heads = k.shape[1]
        if num_kv_heads != num_heads:  # grouped-query heads: each KV head serves H / KVH query heads
            k = k.repeat_interleave(num_heads // num_kv_heads, dim=1)
            v = v.repeat_interleave(num_heads // num_kv_heads, dim=1)
        batch, width = meta.num_seqs, meta.max_seq_len
        if batch == 1:
            out = F.scaled_dot_product_attention(q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1),
                                                 scale=scale)
            return out.transpose(0, 1)
        padded = [_scatter(x, meta.padded_index, batch * width).view(batch, width, num_heads, head_dim).transpose(1, 2)
                  for x in (q, k, v)]
        out = F.scaled_dot_product_attention(*padded, attn_mask=meta.key_mask, scale=scale)
        return out.transpose(1, 2).reshape(batch * width, num_heads, head_dim)[meta.padded_index]


def _scatter(x: torch.Tensor, index: torch.Tensor, rows: int) -> torch.Tensor:
    if x.shape[0] == rows:  # no padding: the packed rows already are the padded layout
        return x
    out = x.new_zeros((rows, *x.shape[1:]))
    out[index] = x
    return out
