"""`--quantization int8` (an aserve extension; vLLM has no such name): weight-only 8-bit, quantized at
load time from a float checkpoint, one symmetric scale per output channel, applied with torch's
`_weight_int8pack_mm` (CPU). Like the int4 kernel, its fp32 form costs time per row, so fp32 batches of
more than `FP32_KERNEL_MAX_ROWS` rows (prompts) multiply by the weight dequantized on the fly. The kernel
(`int8_linear`) also serves 8-bit channel-wise symmetric checkpoint layers (`checkpoint_int.py`)."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

from aserve.model.quantization.base import drop_weights, register_weight
from aserve.model.quantization.int4_cpu import FP32_KERNEL_MAX_ROWS
from aserve.model.quantization.unquantized import UnquantizedLinearMethod

if TYPE_CHECKING:
    from aserve.model.layers.linear import Linear


def quantize_int8(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """`(q int8 [N, K] in -127..127, scale fp32 [N])` with `weight ~= q * scale[:, None]`."""
    w = weight.detach().float()
    scale = w.abs().amax(dim=1) / 127.0
    safe = torch.where(scale > 0, scale, torch.ones_like(scale))
    q = (w / safe.unsqueeze(1)).round_().clamp_(-127, 127).to(torch.int8)
    return q, scale


class Int8WeightOnlyMethod(UnquantizedLinearMethod):
    """Loads the float `weight` like the unquantized method, then replaces it with int8 + scales."""

    name = "int8"

    def process_weights_after_loading(self, layer: Linear) -> None:
        q, scale = quantize_int8(layer.weight.data)
        drop_weights(layer)
        register_weight(layer, "int8_weight", q.contiguous())
        register_weight(layer, "int8_scales", scale.to(layer.params_dtype))

    def apply(self, layer: Linear, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        return int8_linear(x, layer.int8_weight, layer.int8_scales, bias)


def int8_linear(x: torch.Tensor, q: torch.Tensor, scales: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """`x @ (q * scales[:, None]).T (+ bias)` for int8 `q [N, K]` and `scales [N]` in x's dtype (also used by
    8-bit channel-wise checkpoint layers, `checkpoint_int.py`)."""
    lead = x.shape[:-1]
    x2 = x.reshape(-1, x.shape[-1])
    if x2.dtype == torch.float32 and x2.shape[0] > FP32_KERNEL_MAX_ROWS:
        return F.linear(x, q.float() * scales.unsqueeze(1), bias)
    if not x2.is_contiguous():
        x2 = x2.contiguous()
    y = torch._weight_int8pack_mm(x2, q, scales)
    if bias is not None:
        y = y.add_(bias)
    return y.reshape(*lead, y.shape[-1])
