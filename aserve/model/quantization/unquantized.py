"""`UnquantizedLinearMethod`: the float weight `[output_size, input_size]` of Hugging Face checkpoints,
applied with `F.linear` (the default method of every `Linear`)."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

from aserve.model.quantization.base import LinearMethodBase, register_weight

if TYPE_CHECKING:
    from aserve.model.layers.linear import Linear


class UnquantizedLinearMethod(LinearMethodBase):
    """`weight [output_size, input_size]` in the layer's dtype; `F.linear`."""

    name = "unquantized"

    def create_weights(self, layer: Linear, device: torch.device | str | None = None) -> None:
        register_weight(layer, "weight", torch.empty(layer.output_size, layer.input_size,
                                                     dtype=layer.params_dtype, device=device))

    def apply(self, layer: Linear, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        return F.linear(x, layer.weight, bias)
