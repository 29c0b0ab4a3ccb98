"""Gated activations."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from aserve.kernels import reference
from aserve.model.layers.custom_op import CustomOp


class SiluAndMul(CustomOp):
    """x `[T, 2N]` -> `silu(x[:, :N]) * x[:, N:]` (the SwiGLU gate of Llama-family MLPs).

    CPU: in a bf16 model, rows in one C kernel call (`cpu_ops.silu_and_mul`, fp32 inside, one
    rounding; the input may be the gate/up projection's unrounded float32 output, the result is bf16); else
    the gate's silu on a fresh tensor and an in-place multiply (the native form's arithmetic)."""

    def __init__(self, dtype: torch.dtype | None = None):
        super().__init__()
        self.dtype = dtype  # the model's activation dtype

    def forward_native(self, x: torch.Tensor) -> torch.Tensor:
        return reference.silu_and_mul(x)

    def forward_cpu(self, x: torch.Tensor) -> torch.Tensor:
        kernels = self.cpu_kernels
        if kernels is not None and self.dtype == torch.bfloat16 and kernels.accepts_rows(x):
            return kernels.silu_and_mul(x)
        n = x.shape[-1] // 2
        return F.silu(x[..., :n]).mul_(x[..., n:])


def get_act_and_mul(hidden_act: str, dtype: torch.dtype | None = None) -> nn.Module:
    """The gated activation for a config's `hidden_act` in a `dtype` model; raises ValueError for ones
    not implemented."""
    if hidden_act in ("silu", "swish"):
        return SiluAndMul(dtype)
    raise ValueError(f"hidden_act {hidden_act!r} is not implemented (supported: 'silu')")
