"""FP8 (float8_e4m3fn) weights: `quant_method: fp8` checkpoints (vLLM / llm-compressor / DeepSeek / Qwen
FP8), compressed-tensors `float-quantized` checkpoints (FP8_DYNAMIC / FP8 / FP8_BLOCK: the config parser
gives them a `QuantSpec` with method "fp8"; block scales are their `weight_scale`), and online
`--quantization fp8` of a float checkpoint.

Form kept on the layer (output dim first, so a `MergedLinear` stacks q|k|v / gate|up shards along dim 0):
  `fp8_weight` float8_e4m3fn `[N, K]`  the checkpoint's codes (1 byte a weight stays resident)
  `fp8_scale`  fp32 `[N, G]`           one scale per output row and run of `group_size` input columns
                                        (G = 1: per-tensor or per-channel; block scales: G = ceil(K / block_k))
  `w[n, k] = float(q[n, k]) * scale[n, k // group_size]`.
A checkpoint's per-tensor scale is expanded to its shard's rows before stacking, so fused q/k/v and
gate/up with different scales are exact; `weight_block_size [bn, bk]` block scales `[ceil(N/bn),
ceil(K/bk)]` (`weight_scale_inv`) are expanded along the rows the same way.

Kernel, CPU: weight-only. Each call dequantizes the fp8 weight into the activation dtype (bf16 / fp32)
and multiplies with `F.linear`: activations are never quantized (a `static` checkpoint's `input_scale`
is read and dropped), so outputs reflect FP8 *weight* rounding only. No `torch._scaled_mm` here (CPU).
Online `--quantization fp8`: per-output-channel scale `amax / 448`, codes rounded to float8_e4m3fn at
load (vLLM uses a per-tensor scale; per-channel is at least as accurate).

Kernel, CUDA (`cuda_linear.choose_fp8_form`, at load): compute capability >= 8.9, per-tensor / per-channel
scales, K and N multiples of 16: activations quantized to fp8 per token and `torch._scaled_mm`; otherwise
the dequantizing form above. Checked on CPU tensors (torch's CPU `_scaled_mm`), not yet run on a GPU.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

from aserve.model.quantization import cuda_linear
from aserve.model.quantization.base import LinearMethodBase, drop_weights, register_weight
from aserve.model.quantization.unquantized import UnquantizedLinearMethod

if TYPE_CHECKING:
    from aserve.model.layers.linear import Linear

logger = logging.getLogger(__name__)

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = float(torch.finfo(FP8_DTYPE).max)  # 448
KERNEL = "fp8 weight dequantized per call to the activation dtype + F.linear (CPU, weight-only)"
_logged: set[str] = set()


def _log_once(key: str, msg: str, *args) -> None:
    if key not in _logged:
        _logged.add(key)
        logger.info(msg, *args)


def quantize_fp8_per_channel(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """`(q float8_e4m3fn [N, K], scale fp32 [N, 1])` with `weight ~= q.float() * scale`."""
    w = weight.detach().float()
    scale = w.abs().amax(dim=1, keepdim=True) / FP8_MAX
    scale = torch.where(scale > 0, scale, torch.ones_like(scale))
    q = (w / scale).clamp_(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
    return q, scale


def dequantize_fp8(q: torch.Tensor, scale: torch.Tensor, group_size: int, dtype: torch.dtype = torch.float32
                   ) -> torch.Tensor:
    """The weight `q * scale` (`scale [N, G]`, groups of `group_size` input columns, the last possibly shorter)."""
    if scale.shape[1] == 1:
        return (q.to(torch.float32) * scale).to(dtype)
    k = q.shape[1]
    col_group = torch.arange(k, device=q.device) // group_size
    return (q.to(torch.float32) * scale[:, col_group]).to(dtype)


def _fp8_apply(layer: Linear, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    if getattr(layer, "fp8_scaled_mm", False):  # CUDA, compute capability >= 8.9 (cuda_linear.py)
        return cuda_linear.fp8_scaled_linear(layer, x, bias)
    weight = dequantize_fp8(layer.fp8_weight, layer.fp8_scale, layer.fp8_group_size, x.dtype)
    return F.linear(x, weight, bias)


class Fp8CheckpointMethod(LinearMethodBase):
    """FP8 weights read from a `quant_method: fp8` checkpoint (see the module docstring)."""

    name = "fp8"

    def __init__(self, block_k: int | None = None):
        self.block_k = block_k  # weight_block_size[1], or None for per-tensor / per-channel scales

    def create_weights(self, layer: Linear, device: torch.device | str | None = None) -> None:
        n, k = layer.output_size, layer.input_size
        g = 1 if self.block_k is None else -(-k // self.block_k)
        register_weight(layer, "fp8_weight", torch.empty(n, k, dtype=FP8_DTYPE, device=device))
        register_weight(layer, "fp8_scale", torch.empty(n, g, dtype=torch.float32, device=device))

    def process_weights_after_loading(self, layer: Linear) -> None:
        layer.fp8_group_size = layer.input_size if self.block_k is None else self.block_k
        _log_once(f"ckpt:{self.block_k}", "fp8 checkpoint (%s scales): %s; activations unquantized",
                  "per-tensor / per-channel" if self.block_k is None else f"{self.block_k}-column block", KERNEL)
        cuda_linear.choose_fp8_form(layer, "fp8 checkpoint")

    def apply(self, layer: Linear, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        return _fp8_apply(layer, x, bias)


class Fp8OnlineMethod(UnquantizedLinearMethod):
    """`--quantization fp8` of a float checkpoint: loads the float `weight`, then keeps it as fp8 codes
    with a per-output-channel scale."""

    name = "fp8"

    def process_weights_after_loading(self, layer: Linear) -> None:
        q, scale = quantize_fp8_per_channel(layer.weight.data)
        drop_weights(layer)
        register_weight(layer, "fp8_weight", q.contiguous())
        register_weight(layer, "fp8_scale", scale)
        layer.fp8_group_size = layer.input_size
        _log_once("online", "--quantization fp8 (online, per-channel scales): %s; activations unquantized", KERNEL)
        cuda_linear.choose_fp8_form(layer, "--quantization fp8")

    def apply(self, layer: Linear, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        return _fp8_apply(layer, x, bias)


# ---- reading `quant_method: fp8` checkpoints -------------------------------------------------------------
_SCALE_SUFFIXES = ("weight_scale", "weight_scale_inv")  # inv: DeepSeek / Qwen block FP8 (a multiplier despite the name)
_DROPPED_SUFFIXES = ("input_scale",)  # static activation scales: activations are not quantized on CPU


def fp8_prefixes(names) -> set[str]:
    """The module names a checkpoint quantizes to fp8 (those with a `weight_scale` / `weight_scale_inv`)."""
    out = set()
    for name in names:
        prefix, _, suffix = name.rpartition(".")
        if suffix in _SCALE_SUFFIXES:
            out.add(prefix)
    return out


def assign_fp8_methods(model, block_size: tuple[int, int] | None,
                       prefixes: set[str]) -> dict[str, tuple[Linear, int | None]]:
    """Give every Linear whose checkpoint modules are all fp8 the checkpoint method (see
    `assign.set_checkpoint_method`); {prefix: (layer, shard)}."""
    from aserve.model.quantization.assign import set_checkpoint_method

    method = Fp8CheckpointMethod(None if block_size is None else block_size[1])
    return set_checkpoint_method(model, method, prefixes, "fp8 checkpoint")


def fp8_canonical(q: torch.Tensor, scale: torch.Tensor, block_size: tuple[int, int] | None, where: str
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """(fp8 codes [N, K], fp32 scales [N, G]) of one checkpoint module (see the module docstring)."""
    if q.dtype != FP8_DTYPE:
        raise ValueError(f"{where}: fp8 checkpoint weight has dtype {q.dtype}; implemented: float8_e4m3fn")
    n, k = q.shape
    s = scale.float()
    if block_size is None:
        if s.numel() == 1:
            s = s.reshape(1, 1).expand(n, 1)
        elif s.numel() == n:
            s = s.reshape(n, 1)
        else:
            raise ValueError(f"{where}: weight_scale {tuple(scale.shape)} is neither per-tensor nor per-channel "
                             f"for a [{n}, {k}] weight (block scales need weight_block_size)")
    else:
        bn, bk = block_size
        want = (-(-n // bn), -(-k // bk))
        if tuple(s.shape) != want:
            raise ValueError(f"{where}: block scales {tuple(scale.shape)} do not fit a [{n}, {k}] weight with "
                             f"weight_block_size {list(block_size)} (expected {list(want)})")
        s = s.repeat_interleave(bn, dim=0)[:n]
    return q.contiguous(), s.contiguous()


def fp8_weights(weights, block_size: tuple[int, int] | None, targets: dict[str, tuple[Linear, int | None]]):
    """`weights` with each fp8 module's `weight` + scale replaced by `<module>.fp8_weight / .fp8_scale`
    (its `input_scale` dropped)."""
    pending: dict[str, dict[str, torch.Tensor]] = {}
    for name, tensor in weights:
        prefix, _, suffix = name.rpartition(".")
        if prefix not in targets:
            yield name, tensor
            continue
        if suffix in _DROPPED_SUFFIXES:
            continue
        if suffix != "weight" and suffix not in _SCALE_SUFFIXES:
            yield name, tensor  # bias
            continue
        parts = pending.setdefault(prefix, {})
        parts[suffix] = tensor
        scale = next((parts[s] for s in _SCALE_SUFFIXES if s in parts), None)
        if "weight" in parts and scale is not None:
            q, s = fp8_canonical(parts["weight"], scale, block_size, prefix)
            del pending[prefix]
            yield f"{prefix}.fp8_weight", q
            yield f"{prefix}.fp8_scale", s
    if pending:
        raise ValueError(f"fp8 checkpoint: {sorted(pending)[:4]} lack a weight or its scale")
