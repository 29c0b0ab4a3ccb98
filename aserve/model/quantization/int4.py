"""`--quantization int4` (an aserve extension; vLLM has no such name): weight-only 4-bit, quantized at
load time from a float checkpoint, group size 32, asymmetric min/max per group, CPU only.

Layers whose shape the kernel cannot take (`int4_packable`) keep their float weight.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from aserve.model.quantization.base import drop_weights
from aserve.model.quantization.int4_cpu import GROUP_SIZE, int4_linear, pack_int4, quantize_int4
from aserve.model.quantization.unquantized import UnquantizedLinearMethod

if TYPE_CHECKING:
    from aserve.model.layers.linear import Linear


class Int4WeightOnlyMethod(UnquantizedLinearMethod):
    """Loads the float `weight` like the unquantized method, then replaces it with packed int4."""

    name = "int4"

    def __init__(self, group_size: int = GROUP_SIZE):
        self.group_size = group_size

    def process_weights_after_loading(self, layer: Linear) -> None:
        q, scale, zero = quantize_int4(layer.weight.data, self.group_size)
        drop_weights(layer)
        pack_int4(layer, q, scale, zero, layer.params_dtype, self.group_size)

    def apply(self, layer: Linear, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        return int4_linear(layer, x, self.group_size, bias)
