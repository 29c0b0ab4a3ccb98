"""The attention layer: owns one layer's KV-cache tensor and hands q/k/v to the backend."""

from __future__ import annotations

import torch
from torch import nn

from aserve.model.attention.base import AttentionBackend, AttentionMetadata


class Attention(nn.Module):
    """q `[T, H*D]`, k/v `[T, KVH*D]` -> `[T, H*D]`: writes this step's K/V, then attends.

    The KV cache (`[2, num_blocks, block_size, KVH, D]`) is bound after the runner allocates it;
    calling forward before `bind_kv_cache` raises RuntimeError. `sliding_window` is this layer's
    (None: full attention); layers of one model may differ. `logit_softcap` caps the scores
    (`softcap * tanh(s / softcap)`, Gemma 2) or is None.
    """

    def __init__(self, num_heads: int, head_dim: int, num_kv_heads: int, scale: float,
                 backend: AttentionBackend, sliding_window: int | None = None,
                 logit_softcap: float | None = None):
        super().__init__()
        if num_heads % num_kv_heads:
            raise ValueError(f"num_attention_heads ({num_heads}) must be a multiple of "
                             f"num_key_value_heads ({num_kv_heads})")
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.scale = scale
        self.backend = backend
        self.sliding_window = sliding_window
        self.logit_softcap = logit_softcap
        self.kv_cache: torch.Tensor | None = None

    def bind_kv_cache(self, kv_cache: torch.Tensor) -> None:
        expected = (2, self.num_kv_heads, self.head_dim)
        got = (kv_cache.shape[0], kv_cache.shape[3], kv_cache.shape[4]) if kv_cache.dim() == 5 else None
        if got != expected:
            raise ValueError(f"KV cache must be [2, num_blocks, block_size, {self.num_kv_heads}, {self.head_dim}], "
                             f"got {list(kv_cache.shape)}")
        self.kv_cache = kv_cache

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        if self.kv_cache is None:
            raise RuntimeError("no KV cache bound: call bind_kv_caches before forward")
        num_tokens = q.shape[0]
        out = self.backend.forward(
            q.view(num_tokens, self.num_heads, self.head_dim),
            k.view(num_tokens, self.num_kv_heads, self.head_dim),
            v.view(num_tokens, self.num_kv_heads, self.head_dim),
            self.kv_cache, meta, self.scale, self.sliding_window, self.logit_softcap,
        )
        return out.view(num_tokens, self.num_heads * self.head_dim)


def split_qkv_heads(qkv: torch.Tensor, split, num_heads: int, num_kv_heads: int, head_dim: int,
                    q_norm: nn.Module | None = None,
                    k_norm: nn.Module | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A fused q|k|v projection's output `[T, (H + 2 KVH) * D]` (split by `split`, the layer's
    `MergedLinear.split`) as q `[T, H, D]`, k `[T, KVH, D]`, v `[T, KVH * D]`; with norms, q and k are
    normalized per head (rows of D: Qwen3, Gemma 3) before the caller's rotary."""
    q, k, v = split(qkv)
    num_tokens = qkv.shape[0]
    if q_norm is not None and k_norm is not None:
        q = q_norm(q.reshape(-1, head_dim))
        k = k_norm(k.reshape(-1, head_dim))
    return (q.reshape(num_tokens, num_heads, head_dim), k.reshape(num_tokens, num_kv_heads, head_dim), v)
