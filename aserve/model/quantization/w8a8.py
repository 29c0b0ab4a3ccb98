"""W8A8 int8: compressed-tensors `int-quantized` checkpoints (llm-compressor's SmoothQuant + GPTQ W8A8,
`-q smooth_quant`), served as vLLM serves them: int8 weights times int8 activations, int32 accumulation.

Checkpoint tensors per quantized Linear: `weight` int8 `[N, K]`, `weight_scale` fp32 `[N, 1]` (strategy
"channel") or one value (strategy "tensor"), `input_scale` (one value, static activations only), and an
all-zero `weight_zero_point` / `input_zero_point` if written (symmetric; dropped).

Form kept on the layer (output dim first, so a `MergedLinear` stacks q|k|v / gate|up along dim 0):
  `w8a8_weight`  int8 `[N, K]`  the checkpoint's codes (1 byte a weight stays resident)
  `w8a8_scale`   fp32 `[N]`     the weight scale of each output row (a per-tensor scale expanded to its
                                shard's rows, so fused shards with different scales are exact)
  `w8a8_input_scale` fp32 `[]`  static only: one activation scale. A fused layer's shards each carry one
                                (loaded per row, `[N]`, then reduced); their maximum is used, as vLLM does.

`apply` (`w8a8_linear`), per row `r` of x (rows of `x.reshape(-1, K)`):
  a[r] = amax(|x[r]|) / 127 (dynamic; 1 for an all-zero row) or the input scale (static)
  xq[r] = clamp(round_half_even(x[r] / a[r]), -128, 127) as int8
  y[r, n] = (sum_k xq[r, k] * w[n, k]) * a[r] * w_scale[n] (+ bias[n]), computed in fp32, returned in x's dtype.
The integer product runs in `torch._int_mm` (CPU, int8 x int8 -> int32, exact); `w8a8_reference` is
the same arithmetic in plain torch (an fp64 matmul of the integers, also exact) for tests.
Like vLLM, the dynamic scale is `amax / 127` (`ACT_QMAX`). compressed-tensors' fake quantization (what
transformers runs for such a checkpoint) uses `amax / 127.5`: a different grid, so activations round
differently and outputs differ from transformers' by about the activation quantization noise.
On CUDA (`cuda_linear.w8a8_linear_cuda`, chosen at load) the same arithmetic runs in CUDA's `torch._int_mm`
(its limits met by padding rows, or an fp32 matmul of the codes); checked on CPU, not yet run on a GPU.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Iterator
from typing import TYPE_CHECKING

import torch

from aserve.model.quantization import cuda_linear
from aserve.model.quantization.base import LinearMethodBase, register_weight

if TYPE_CHECKING:
    from aserve.model.layers.linear import Linear

logger = logging.getLogger(__name__)

KERNEL = "int8 activations x int8 weights in torch._int_mm (int32 accumulation), fp32 rescale"
CUDA_KERNEL = "CUDA: " + KERNEL + " (cuBLASLt; batches of <= 16 rows padded to 17)"
CUDA_FALLBACK = "CUDA: int8 activations x int8 weights as an fp32 matmul (K or N not a multiple of 8), fp32 rescale"
ACT_QMAX = 127.0  # dynamic activation scale = amax / ACT_QMAX (vLLM's; compressed-tensors' fake quantization: 127.5)
_logged: set[str] = set()


def quantize_rows(x: torch.Tensor, input_scale: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """`(xq int8 [M, K], a fp32 [M, 1] or [])` for 2-D `x`: symmetric int8 per row (`amax / 127`), or with
    the static `input_scale` (see the module docstring)."""
    xf = x.float()
    if input_scale is None:
        a = xf.abs().amax(dim=1, keepdim=True).div_(ACT_QMAX)
        a = torch.where(a > 0, a, torch.ones_like(a))
    else:
        a = input_scale
    return torch.round(xf / a).clamp_(-128, 127).to(torch.int8), a


def w8a8_linear(x: torch.Tensor, q: torch.Tensor, w_scale: torch.Tensor, input_scale: torch.Tensor | None,
                bias: torch.Tensor | None) -> torch.Tensor:
    """`x [..., K]` times int8 `q [N, K]` with per-row weight scales `w_scale [N]` (module docstring)."""
    lead = x.shape[:-1]
    xq, a = quantize_rows(x.reshape(-1, x.shape[-1]), input_scale)
    y = torch._int_mm(xq, q.t()).float().mul_(a).mul_(w_scale)
    if bias is not None:
        y = y.add_(bias.float())
    return y.to(x.dtype).reshape(*lead, q.shape[0])


def w8a8_reference(x: torch.Tensor, q: torch.Tensor, w_scale: torch.Tensor, input_scale: torch.Tensor | None = None,
                   bias: torch.Tensor | None = None) -> torch.Tensor:
    """The semantics of `w8a8_linear` in plain torch (fp64 integer product); `w_scale` `[N]`, `[N, 1]` or one."""
    x2 = x.reshape(-1, x.shape[-1]).float()
    if input_scale is None:
        a = x2.abs().amax(dim=1, keepdim=True) / ACT_QMAX
        a = torch.where(a > 0, a, torch.ones_like(a))
    else:
        a = input_scale.float().reshape(())
    xq = torch.round(x2 / a).clamp(-128, 127)
    acc = (xq.double() @ q.double().t()).float()
    y = acc * a * w_scale.float().reshape(-1)
    if bias is not None:
        y = y + bias.float()
    return y.to(x.dtype).reshape(*x.shape[:-1], q.shape[0])


class W8A8Int8Method(LinearMethodBase):
    """W8A8 int8 weights read from a compressed-tensors `int-quantized` checkpoint (module docstring)."""

    name = "w8a8_int8"

    def __init__(self, static: bool):
        self.static = static  # static per-tensor activation scale (else dynamic per token)

    def create_weights(self, layer: Linear, device: torch.device | str | None = None) -> None:
        n, k = layer.output_size, layer.input_size
        register_weight(layer, "w8a8_weight", torch.empty(n, k, dtype=torch.int8, device=device))
        register_weight(layer, "w8a8_scale", torch.empty(n, dtype=torch.float32, device=device))
        if self.static:
            register_weight(layer, "w8a8_input_scale", torch.empty(n, dtype=torch.float32, device=device))

    def process_weights_after_loading(self, layer: Linear) -> None:
        if self.static:
            scale = layer.w8a8_input_scale.data.amax()
            if not bool(scale > 0):
                raise ValueError(f"w8a8 checkpoint: a non-positive input_scale ({float(scale)})")
            del layer._parameters["w8a8_input_scale"]
            register_weight(layer, "w8a8_input_scale", scale.reshape(()))
        layer.w8a8_cuda = cuda_linear.use_cuda_forms(layer.w8a8_weight.device)
        kernel = KERNEL
        if layer.w8a8_cuda:
            n, k = layer.w8a8_weight.shape
            kernel = CUDA_KERNEL if cuda_linear.int_mm_fits(n, k) else CUDA_FALLBACK
            cuda_linear.transpose_w8a8(layer)
        key = f"{'static' if self.static else 'dynamic'}:{kernel}"
        if key not in _logged:
            _logged.add(key)
            logger.info("w8a8 int8 checkpoint (%s activations): %s", "static per-tensor" if self.static
                        else "dynamic per-token", kernel)

    def apply(self, layer: Linear, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        if getattr(layer, "w8a8_cuda", False):
            return cuda_linear.w8a8_linear_cuda(x, layer.w8a8_weight_kn, layer.w8a8_scale,
                                                getattr(layer, "w8a8_input_scale", None), bias)
        return w8a8_linear(x, layer.w8a8_weight, layer.w8a8_scale, getattr(layer, "w8a8_input_scale", None), bias)


# ---- reading the checkpoint -------------------------------------------------------------------------------
_PARTS = ("weight", "weight_scale", "input_scale", "weight_zero_point", "input_zero_point")


def w8a8_prefixes(names: Iterable[str]) -> set[str]:
    """The module names a checkpoint quantizes (those with a `weight_scale`)."""
    return {name[: -len(".weight_scale")] for name in names if name.endswith(".weight_scale")}


def assign_w8a8_methods(model, static: bool, prefixes: set[str]) -> dict[str, tuple[Linear, int | None]]:
    """Give every Linear whose checkpoint modules are all W8A8 the method (`assign.set_checkpoint_method`)."""
    from aserve.model.quantization.assign import set_checkpoint_method

    return set_checkpoint_method(model, W8A8Int8Method(static), prefixes, "w8a8 checkpoint")


def _per_row(t: torch.Tensor, n: int, what: str, where: str) -> torch.Tensor:
    t = t.float()
    if t.numel() == 1:
        return t.reshape(1).expand(n).contiguous()
    if t.numel() == n:
        return t.reshape(n).contiguous()
    raise ValueError(f"{where}: {what} {tuple(t.shape)} is neither per-tensor nor per-channel for {n} output rows")


def w8a8_canonical(parts: dict[str, torch.Tensor], static: bool, where: str) -> dict[str, torch.Tensor]:
    """The layer's tensors (`w8a8_weight`, `w8a8_scale`, static: `w8a8_input_scale [N]`) from one
    checkpoint module's; ValueError when they do not fit."""
    q = parts["weight"]
    if q.dtype != torch.int8 or q.dim() != 2:
        raise ValueError(f"{where}: W8A8 weight is {q.dtype} {tuple(q.shape)}; expected int8 [N, K]")
    for suffix in ("weight_zero_point", "input_zero_point", "input_scale"):
        if suffix in parts:
            _check_optional(suffix, parts[suffix], static, where)
    n = q.shape[0]
    out = {"w8a8_weight": q.contiguous(), "w8a8_scale": _per_row(parts["weight_scale"], n, "weight_scale", where)}
    if static:
        out["w8a8_input_scale"] = _per_row(parts["input_scale"], n, "input_scale", where)
    return out


def _check_optional(suffix: str, tensor: torch.Tensor, static: bool, where: str) -> None:
    """ValueError for a non-zero `weight_zero_point` / `input_zero_point`, or an `input_scale` with dynamic
    activations (all-zero zero points, which symmetric checkpoints may write, are dropped)."""
    if suffix in ("weight_zero_point", "input_zero_point") and bool(tensor.any()):
        raise ValueError(f"{where}: non-zero {suffix} (asymmetric quantization is not implemented)")
    if suffix == "input_scale" and not static:
        raise ValueError(f"{where}: an input_scale, but the config's input_activations are dynamic")


def w8a8_weights(weights: Iterable[tuple[str, torch.Tensor]], static: bool,
                 targets: dict[str, tuple[Linear, int | None]]) -> Iterator[tuple[str, torch.Tensor]]:
    """`weights` with each W8A8 module's tensors replaced by the layer's form (`w8a8_canonical`), emitted as
    soon as a module's required tensors have come (a later zero point or input_scale is still checked)."""
    needed = ("weight", "weight_scale", "input_scale") if static else ("weight", "weight_scale")
    pending: dict[str, dict[str, torch.Tensor]] = {}
    done: set[str] = set()
    for name, tensor in weights:
        prefix, _, suffix = name.rpartition(".")
        if prefix not in targets or suffix not in _PARTS:
            yield name, tensor  # other modules, biases
            continue
        if prefix in done:  # an optional part after the module was emitted
            _check_optional(suffix, tensor, static, prefix)
            continue
        parts = pending.setdefault(prefix, {})
        parts[suffix] = tensor
        if all(p in parts for p in needed):
            done.add(prefix)
            for key, value in w8a8_canonical(pending.pop(prefix), static, prefix).items():
                yield f"{prefix}.{key}", value
    if pending:
        missing = {prefix: [p for p in needed if p not in parts] for prefix, parts in sorted(pending.items())}
        raise ValueError(f"w8a8 checkpoint: modules lack tensors: {dict(list(missing.items())[:4])}")
