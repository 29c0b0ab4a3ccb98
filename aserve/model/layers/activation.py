"""Gated activations."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from aserve.kernels import reference
from aserve.kernels.activation import silu_and_mul as triton_silu_and_mul
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

    def forward_cuda(self, x: torch.Tensor) -> torch.Tensor:
        """The Triton kernel (`kernels/activation.py`: fp32 inside, one rounding)."""
        return triton_silu_and_mul(x)

    def forward_cpu(self, x: torch.Tensor) -> torch.Tensor:
        kernels = self.cpu_kernels
        if kernels is not None and self.dtype == torch.bfloat16 and kernels.accepts_rows(x):
            return kernels.silu_and_mul(x)
        n = x.shape[-1] // 2
        return F.silu(x[..., :n]).mul_(x[..., n:])


class GeluAndMul(CustomOp):
    """x `[T, 2N]` -> `gelu(x[:, :N]) * x[:, N:]` (GeGLU: Gemma's MLP); `approximate` is torch's
    ("tanh" for `gelu_pytorch_tanh`, "none" for exact gelu).

    CPU: the tanh form in a bf16 model is one C kernel call (`cpu_ops.gelu_tanh_and_mul`, fp32 inside, one
    rounding; the input may be float32); else the native form."""

    def __init__(self, approximate: str = "tanh", dtype: torch.dtype | None = None):
        super().__init__()
        self.approximate = approximate
        self.dtype = dtype  # the model's activation dtype

    def forward_native(self, x: torch.Tensor) -> torch.Tensor:
        n = x.shape[-1] // 2
        return F.gelu(x[..., :n], approximate=self.approximate) * x[..., n:]

    def forward_cpu(self, x: torch.Tensor) -> torch.Tensor:
        kernels = self.cpu_kernels
        if (kernels is not None and self.approximate == "tanh" and self.dtype == torch.bfloat16
                and kernels.accepts_rows(x)):
            return kernels.gelu_tanh_and_mul(x)
        return self.forward_native(x)


_GATED = {"silu": None, "swish": None, "gelu_pytorch_tanh": "tanh", "gelu_new": "tanh", "gelu": "none"}


def get_act_and_mul(hidden_act: str, dtype: torch.dtype | None = None) -> nn.Module:
    """The gated activation for a config's `hidden_act` in a `dtype` model; raises ValueError for ones
    not implemented."""
    if hidden_act not in _GATED:
        raise ValueError(f"hidden_act {hidden_act!r} is not implemented (supported: {sorted(_GATED)})")
    approximate = _GATED[hidden_act]
    return SiluAndMul(dtype) if approximate is None else GeluAndMul(approximate, dtype)


# Non-gated MLP activations (GPT-2's `activation_function`, OPT's); transformers' names. `gelu_new` is
# the tanh approximation (NewGELUActivation), as is `gelu_pytorch_tanh`.
_NON_GATED = {"gelu": lambda: nn.GELU(), "gelu_new": lambda: nn.GELU(approximate="tanh"),
              "gelu_pytorch_tanh": lambda: nn.GELU(approximate="tanh"), "relu": lambda: nn.ReLU()}


def get_act_fn(activation: str) -> nn.Module:
    """The elementwise activation named `activation` (transformers' ACT2FN names); raises ValueError
    for ones not implemented (aserve.config.families.NON_GATED_ACTIVATIONS lists the same names)."""
    if activation not in _NON_GATED:
        raise ValueError(f"activation {activation!r} is not implemented (supported: {sorted(_NON_GATED)})")
    return _NON_GATED[activation]()
