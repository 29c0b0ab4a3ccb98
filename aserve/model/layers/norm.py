"""RMSNorm with an optional fused residual add."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from aserve.kernels import reference
from aserve.model.layers.custom_op import CustomOp


class RMSNorm(CustomOp):
    """`forward(x)` -> normed; `forward(x, residual)` -> `(normed(x + residual), x + residual)`.

    Native: Hugging Face's order (normalize in fp32, round to x's dtype, then scale by the weight).
    CPU: for a bf16 model the C kernel (`cpu_ops.rms_norm`, the residual add and the norm in one call;
    x may be a projection's unrounded float32 output, and the sum it returns is float32, unrounded, so
    the residual stream stays float32 from layer to layer; the normed output is bf16), else torch's `F.rms_norm`; both fp32 inside with one rounding at the end:
    identical in fp32, within one bf16 rounding of the native form in bf16.
    """

    def __init__(self, hidden_size: int, eps: float = 1e-6, dtype: torch.dtype | None = None):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(hidden_size, dtype=dtype), requires_grad=False)

    def forward_native(
        self, x: torch.Tensor, residual: torch.Tensor | None = None
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        return reference.rms_norm(x, self.weight, self.eps, residual)

    def forward_cpu(
        self, x: torch.Tensor, residual: torch.Tensor | None = None
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        kernels = self.cpu_kernels
        if (kernels is not None and self.weight.dtype == torch.bfloat16 and kernels.accepts_rows(x)
                and (residual is None or kernels.accepts_rows(residual))):
            return kernels.rms_norm(x, self.weight, self.eps, residual)
        if residual is None:
            return F.rms_norm(x, self.weight.shape, self.weight, self.eps)
        summed = x + residual
        return F.rms_norm(summed, self.weight.shape, self.weight, self.eps), summed

    def load_shard(self, param: torch.Tensor, loaded: torch.Tensor, shard_id: int | None = None) -> None:
        if tuple(param.shape) != tuple(loaded.shape):
            raise ValueError(f"checkpoint tensor has shape {tuple(loaded.shape)}, expected {tuple(param.shape)}")
        param.data.copy_(loaded)

    def extra_repr(self) -> str:
        return f"{self.weight.shape[0]}, eps={self.eps}, form={self.form}"
