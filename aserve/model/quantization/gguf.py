"""`--quantization gguf`: serve a GGUF file's Q4_0 / Q4_1 Linear weights natively (CPU int4 kernel).

The loader fills, per layer, `qweight` (uint8 `[N, K]`, values 0..15), `scales` and `zeros` (fp32
`[N, K/32]`) decoded from the file's blocks (`gguf_reader.GGUFLinearWeights.int4_components`) in the
form `w = (q - 8) * scale + zero`; after loading they are packed for a 4-bit kernel (`int4_cpu.py`).
With fp32 activations the layer computes the file's dequantized weight to float rounding; with bf16
activations (the fast path) aserve's C kernel rounds only the activations where it is built, torch's
kernel also rounds the scales and zeros to bf16 elsewhere.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from aserve.model.quantization.base import LinearMethodBase, drop_weights, register_weight
from aserve.model.quantization.gguf_reader import GGUF_GROUP_SIZE
from aserve.model.quantization.int4_cpu import int4_linear, pack_int4

if TYPE_CHECKING:
    from aserve.model.layers.linear import Linear

# The parameters the GGUF weight iterator yields per Linear, as `<module>.<suffix>`.
GGUF_INT4_SUFFIXES = ("qweight", "scales", "zeros")


class GGUFInt4Method(LinearMethodBase):
    """GGUF Q4_0 / Q4_1 blocks of 32, kept in 4 bits (see the module docstring)."""

    name = "gguf"

    def create_weights(self, layer: Linear, device: torch.device | str | None = None) -> None:
        n, k = layer.output_size, layer.input_size
        register_weight(layer, "qweight", torch.empty(n, k, dtype=torch.uint8, device=device))
        register_weight(layer, "scales", torch.empty(n, k // GGUF_GROUP_SIZE, dtype=torch.float32, device=device))
        register_weight(layer, "zeros", torch.empty(n, k // GGUF_GROUP_SIZE, dtype=torch.float32, device=device))

    def process_weights_after_loading(self, layer: Linear) -> None:
        q, scale, zero = layer.qweight.data, layer.scales.data, layer.zeros.data
        drop_weights(layer)
        pack_int4(layer, q, scale, zero, layer.params_dtype, GGUF_GROUP_SIZE)

    def apply(self, layer: Linear, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        return int4_linear(layer, x, GGUF_GROUP_SIZE, bias)


