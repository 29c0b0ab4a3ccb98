"""Gated activations."""

from __future__ import annotations

import torch
from torch import nn

from aserve.kernels import reference


class SiluAndMul(nn.Module):
    """x `[T, 2N]` -> `silu(x[:, :N]) * x[:, N:]` (the SwiGLU gate of Llama-family MLPs)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return reference.silu_and_mul(x)


def get_act_and_mul(hidden_act: str) -> nn.Module:
    """The gated activation for a config's `hidden_act`; raises ValueError for ones not implemented."""
    if hidden_act in ("silu", "swish"):
        return SiluAndMul()
    raise ValueError(f"hidden_act {hidden_act!r} is not implemented (supported: 'silu')")
