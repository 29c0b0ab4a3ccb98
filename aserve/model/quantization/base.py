"""The quantization-method hook of `Linear` (vLLM's `LinearMethodBase`).

A method decides how a `Linear` stores its weight and how it multiplies by it. Methods are
stateless: the tensors live on the layer, so one method object can serve every layer it is given
to. Model files never choose a method; the loader does (`aserve/model/loader.py`), which keeps
quantization out of the model code.

Lifecycle, per layer:
  1. `create_weights(layer, device)` registers the parameters the checkpoint fills. Fused layers
     (`MergedLinear`) load shard `i` into rows `[offsets[i], offsets[i] + output_sizes[i])` of dim 0
     of *every* parameter, so each parameter a method creates has the output dim first.
  2. The loader fills them through `Linear.load_shard`.
  3. `process_weights_after_loading(layer)` turns them into the form `apply` uses (packing,
     quantizing, re-laying out), once.
  4. `apply(layer, x, bias)`: `x [..., input_size]` -> `x @ W.T + bias`, `[..., output_size]`, in
     x's dtype.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from aserve.model.layers.linear import Linear


class LinearMethodBase(ABC):
    """How a `Linear` holds and applies its weight (see the module docstring for the lifecycle)."""

    #: The name logs and `--quantization` use ("unquantized" for the float path).
    name: str = ""

    @abstractmethod
    def create_weights(self, layer: Linear, device: torch.device | str | None = None) -> None:
        """Register on `layer` the parameters the checkpoint loader fills (output dim first)."""

    def process_weights_after_loading(self, layer: Linear) -> None:
        """Convert the loaded parameters into the form `apply` uses; default: keep them as loaded."""

    @abstractmethod
    def apply(self, layer: Linear, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        """`x @ W.T (+ bias)` for `x [..., input_size]`, in x's dtype."""


def register_weight(layer: torch.nn.Module, name: str, tensor: torch.Tensor) -> None:
    """Register `tensor` as a frozen parameter `name` of `layer` (the loader fills parameters)."""
    layer.register_parameter(name, torch.nn.Parameter(tensor, requires_grad=False))


def drop_weights(layer: torch.nn.Module, keep: tuple[str, ...] = ("bias",)) -> None:
    """Remove every direct parameter and buffer of `layer` except those named in `keep`."""
    for name in list(layer._parameters):
        if name not in keep:
            del layer._parameters[name]
    for name in list(layer._buffers):
        if name not in keep:
            del layer._buffers[name]
