"""The attention layer: owns one layer's KV-cache tensor and hands q/k/v to the backend."""

from __future__ import annotations

import torch
from torch import nn

from aserve.model.attention.base import AttentionBackend, AttentionMetadata, DecodeInputs


class Attention(nn.Module):
    """q `[T, H*D]`, k/v `[T, KVH*D]` -> `[T, H*D]`: writes this step's K/V, then attends.

    The KV cache (`[2, num_blocks, block_size, KVH, D]`) is bound after the runner allocates it;
    calling forward before `bind_kv_cache` raises RuntimeError. `sliding_window` is this layer's
    (None: full attention); layers of one model may differ. `logit_softcap` caps the scores
    (`softcap * tanh(s / softcap)`, Gemma 2) or is None.

    fp8 KV caches: `k_scale` / `v_scale` are this layer's scales (K/V are stored as `fp8(k / k_scale)`), set
    from the checkpoint, `--quantization-param-path` or `--calculate-kv-scales` (aserve/model/kv_scales.py);
    1.0 otherwise. With `calculate_kv_scales` set, the next forward over an `AttentionMetadata` step computes
    them from its K/V (amax / the fp8 max) and clears the flag, so they stay fixed afterwards.
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
        self.k_scale = 1.0
        self.v_scale = 1.0
        self.kv_scales_source: str | None = None  # "checkpoint" | "file" | "calculated" (None: 1.0 defaults)
        self.calculate_kv_scales = False

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
            self.kv_cache, meta, self.scale, self.sliding_window, self.logit_softcap, *self.kv_scales(k, v, meta),
        )
        return out.view(num_tokens, self.num_heads * self.head_dim)

    def kv_scales(self, k: torch.Tensor, v: torch.Tensor,
                  meta: AttentionMetadata | DecodeInputs) -> tuple[float, float]:
        """This layer's (k_scale, v_scale) for this step; computes them first when `calculate_kv_scales` is
        set and this is a planned step (not a compiled decode), from its real tokens' K/V (k, v: `[T, ...]`)."""
        if self.calculate_kv_scales and isinstance(meta, AttentionMetadata) and self.kv_cache is not None:
            from aserve.model.kv_scales import calculated_scale

            rows = meta.num_tokens
            self.k_scale = calculated_scale(k[:rows], self.kv_cache.dtype)
            self.v_scale = calculated_scale(v[:rows], self.kv_cache.dtype)
            self.kv_scales_source = "calculated"
            self.calculate_kv_scales = False
        return self.k_scale, self.v_scale


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
