"""Rotary position embeddings (RoPE) with the Hugging Face scaling variants.

The cos/sin table is built once for every position the model can see. Supported `rope_scaling`
types: None/default, linear, dynamic (NTK), llama3, yarn, longrope (Phi-3).
Frequencies follow transformers' `modeling_rope_utils` exactly, except where transformers changes
them with the sequence length, because a paged KV cache cannot re-rotate cached keys as the
sequence grows:

- `dynamic`: (like vLLM) the base is scaled once for the full extended length.
- `longrope` (Phi-3 configs' old names "su" and "yarn" are read as it by the config parser): each
  table row picks its factor set by its own position: positions below
  `original_max_position_embeddings` use `short_factor`, positions at or past it `long_factor`;
  `attention_factor` (default `sqrt(1 + ln(factor) / ln(original_max))`,
  `factor = max_position_embeddings / original_max` unless given) scales every row. transformers
  uses the short factors for a whole sequence while it stays within
  `original_max_position_embeddings` (such sequences match it exactly) and re-rotates the whole
  sequence with the long factors once its length passes that; here a longer sequence keeps its
  first `original_max` positions (and their cached keys) on the short factors, so its logits drift
  from transformers' once it passes that length. (vLLM instead switches every token of a step to
  the long factors when any position in the step passes `original_max`, which makes a sequence's
  rotation depend on its batch mates; a per-position table does not.)
"""

from __future__ import annotations

import math
from typing import Any

import torch
from aserve.kernels import reference
from aserve.kernels.rotary import rotary_embedding as triton_rotary
from aserve.model.layers.custom_op import CustomOp

SUPPORTED_ROPE_TYPES = ("default", "linear", "dynamic", "llama3", "yarn", "longrope")


class RotaryEmbedding(CustomOp):
    """`cos_sin(positions [T]) -> [T, rotary_dim]` once per forward, then per layer
    `forward(cos_sin, q [T, H, D], k [T, KVH, D])` -> rotated `(q, k)` (new tensors).

    Native: `aserve.kernels.reference`'s rotation. CPU, for bf16 in neox style: the C kernel
    (`cpu_ops.rotary_neox`, fp32 inside, one rounding per output); without it, for 16-bit
    activations, two multiplies and two fused multiply-adds per tensor into one output. fp32 keeps
    the native form, which Hugging Face parity relies on.
    """

    def __init__(self, head_dim: int, rotary_dim: int, max_position: int, base: float,
                 rope_scaling: dict[str, Any] | None = None, is_neox: bool = True,
                 dtype: torch.dtype = torch.float32):
        super().__init__()
        self.head_dim = head_dim
        self.rotary_dim = rotary_dim
        self.is_neox = is_neox
        inv_freq, attention_factor, num_positions = _inv_freq(rotary_dim, base, max_position, rope_scaling)
        t = torch.arange(num_positions, dtype=torch.float32)
        freqs = t[:, None] * inv_freq  # inv_freq: one row for every position, or one row per position
        cache = torch.cat((freqs.cos() * attention_factor, freqs.sin() * attention_factor), dim=-1)
        # Stored in the model dtype: HF casts fp32 cos/sin to the activations' dtype before use.
        self.register_buffer("cos_sin_cache", cache.to(dtype), persistent=False)
        # forward_cuda's row indices 0..num_positions-1 (a step has at most that many tokens, else native)
        self.register_buffer("row_ids", torch.arange(num_positions, dtype=torch.int64), persistent=False)

    @property
    def max_position(self) -> int:
        return self.cos_sin_cache.shape[0]

    def cos_sin(self, positions: torch.Tensor) -> torch.Tensor:
        """The table rows `[T, rotary_dim]` (`cat(cos, sin)`) for `positions`; shared by every layer."""
        return self.cos_sin_cache.index_select(0, positions.to(torch.int64))

    def forward_native(self, cos_sin: torch.Tensor, q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        cos, sin = (c.unsqueeze(1) for c in cos_sin.chunk(2, dim=-1))
        return reference.rotate(q, cos, sin, self.is_neox), reference.rotate(k, cos, sin, self.is_neox)

    def forward_cuda(self, cos_sin: torch.Tensor, q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The Triton kernel (`kernels/rotary.py`) with the step's gathered rows as its table: token t
        reads row t (`row_ids`, a buffer made with the module, so CUDA graphs replay valid indices)."""
        num_tokens = q.shape[0]
        if (cos_sin.dtype != q.dtype or q.stride(-1) != 1 or k.stride(-1) != 1
                or num_tokens > self.row_ids.shape[0]):
            return self.forward_native(cos_sin, q, k)
        return triton_rotary(self.row_ids[:num_tokens], q, k, cos_sin.contiguous(), self.is_neox)

    def forward_cpu(self, cos_sin: torch.Tensor, q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        kernels = self.cpu_kernels
        if kernels is not None and self.is_neox and kernels.accepts(q, k, cos_sin):
            return kernels.rotary_neox(q, k, cos_sin)
        if (not self.is_neox or q.dtype == torch.float32 or cos_sin.dtype != q.dtype
                or torch.compiler.is_compiling()):  # inductor fuses the native form; `out=` views break its graph
            return self.forward_native(cos_sin, q, k)
        cos, sin = (c.unsqueeze(1) for c in cos_sin.chunk(2, dim=-1))
        return _rotate_neox_into(q, cos, sin), _rotate_neox_into(k, cos, sin)


def _rotate_neox_into(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """`reference.rotate` (neox) as two multiplies and two fused multiply-adds into one new tensor."""
    half = cos.shape[-1]
    out = torch.empty_like(x, memory_format=torch.contiguous_format)
    x1, x2 = x[..., :half], x[..., half:2 * half]
    o1, o2 = out[..., :half], out[..., half:2 * half]
    torch.mul(x1, cos, out=o1).addcmul_(x2, sin, value=-1)
    torch.mul(x2, cos, out=o2).addcmul_(x1, sin)
    if x.shape[-1] > 2 * half:
        out[..., 2 * half:] = x[..., 2 * half:]
    return out


def _inv_freq(dim: int, base: float, max_position: int,
              scaling: dict[str, Any] | None) -> tuple[torch.Tensor, float, int]:
    """(inverse frequencies `[dim // 2]`, or `[num_positions, dim // 2]` where they depend on the
    position (longrope), cos/sin multiplier, number of positions to tabulate)."""
    exponents = torch.arange(0, dim, 2, dtype=torch.int64).float() / dim
    inv_freq = 1.0 / (base ** exponents)
    kind = (scaling or {}).get("rope_type", (scaling or {}).get("type", "default"))
    if kind not in SUPPORTED_ROPE_TYPES:
        raise ValueError(f"rope_scaling type {kind!r} is not implemented (supported: {SUPPORTED_ROPE_TYPES})")
    if scaling is None or kind == "default":
        return inv_freq, 1.0, max_position
    factor = float(scaling.get("factor") or 1.0)
    if kind == "linear":
        return inv_freq / factor, 1.0, int(max_position * factor)
    if kind == "dynamic":
        num_positions = int(max_position * factor)
        scaled_base = base * ((factor * num_positions / max_position) - (factor - 1)) ** (dim / (dim - 2))
        return 1.0 / (scaled_base ** exponents), 1.0, num_positions
    if kind == "llama3":
        return _llama3_inv_freq(inv_freq, factor, scaling), 1.0, max_position
    if kind == "longrope":
        return _longrope_inv_freq(exponents, base, max_position, scaling)
    return _yarn_inv_freq(dim, base, max_position, scaling)


def _llama3_inv_freq(inv_freq: torch.Tensor, factor: float, scaling: dict[str, Any]) -> torch.Tensor:
    low_freq_factor = float(scaling["low_freq_factor"])
    high_freq_factor = float(scaling["high_freq_factor"])
    old_context_len = float(scaling["original_max_position_embeddings"])
    low_freq_wavelen = old_context_len / low_freq_factor
    high_freq_wavelen = old_context_len / high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_context_len / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    is_medium = ~(wavelen < high_freq_wavelen) & ~(wavelen > low_freq_wavelen)
    return torch.where(is_medium, smoothed, scaled)


def _longrope_inv_freq(exponents: torch.Tensor, base: float, max_position: int,
                       scaling: dict[str, Any]) -> tuple[torch.Tensor, float, int]:
    """transformers' `_compute_longrope_parameters`, per position: rows below
    `original_max_position_embeddings` divide by `short_factor`, the rest by `long_factor`."""
    original = int(scaling.get("original_max_position_embeddings") or max_position)
    factor = scaling.get("factor")
    factor = float(factor) if factor is not None else max_position / original
    attention_factor = scaling.get("attention_factor")
    if attention_factor is None:
        attention_factor = 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(original))
    rows = []
    for key in ("short_factor", "long_factor"):
        ext = torch.tensor(scaling[key], dtype=torch.float32)
        if ext.shape != exponents.shape:
            raise ValueError(f"rope_scaling {key} has {ext.numel()} entries; the rotary dims need "
                             f"{exponents.numel()} (rotary_dim // 2)")
        rows.append(1.0 / (ext * base ** exponents))
    short, long = rows
    num_short = min(original, max_position)
    inv_freq = torch.cat((short.expand(num_short, -1), long.expand(max_position - num_short, -1)))
    return inv_freq, float(attention_factor), max_position


def _yarn_inv_freq(dim: int, base: float, max_position: int,
                   scaling: dict[str, Any]) -> tuple[torch.Tensor, float, int]:
    original = int(scaling.get("original_max_position_embeddings") or max_position)
    factor = scaling.get("factor")
    factor = float(factor) if factor else max_position / original

    def mscale(scale: float, m: float = 1.0) -> float:
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    attention_factor = scaling.get("attention_factor")
    if attention_factor is None:
        m, m_all = scaling.get("mscale"), scaling.get("mscale_all_dim")
        attention_factor = mscale(factor, m) / mscale(factor, m_all) if (m and m_all) else mscale(factor)
    beta_fast = scaling.get("beta_fast") or 32
    beta_slow = scaling.get("beta_slow") or 1

    def correction_dim(num_rotations: float) -> float:
        return (dim * math.log(original / (num_rotations * 2 * math.pi))) / (2 * math.log(base))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if scaling.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001
    ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    pos_freqs = base ** (torch.arange(0, dim, 2).float() / dim)
    extrapolation, interpolation = 1.0 / pos_freqs, 1.0 / (factor * pos_freqs)
    extrapolation_weight = 1 - ramp
    inv_freq = interpolation * (1 - extrapolation_weight) + extrapolation * extrapolation_weight
    num_positions = max(int(max_position * factor), int(original * factor))
    return inv_freq, float(attention_factor), num_positions
