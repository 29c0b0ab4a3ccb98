"""RMSNorm with an optional fused residual add."""

from __future__ import annotations

import torch
from torch import nn

from aserve.kernels import reference


class RMSNorm(nn.Module):
    """`forward(x)` -> normed; `forward(x, residual)` -> `(normed(x + residual), x + residual)`."""

    def __init__(self, hidden_size: int, eps: float = 1e-6, dtype: torch.dtype | None = None):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(hidden_size, dtype=dtype), requires_grad=False)

    def forward(
        self, x: torch.Tensor, residual: torch.Tensor | None = None
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        return reference.rms_norm(x, self.weight, self.eps, residual)

    def load_shard(self, param: torch.Tensor, loaded: torch.Tensor, shard_id: int | None = None) -> None:
        if tuple(param.shape) != tuple(loaded.shape):
            raise ValueError(f"checkpoint tensor has shape {tuple(loaded.shape)}, expected {tuple(param.shape)}")
        param.data.copy_(loaded)

    def extra_repr(self) -> str:
        return f"{self.weight.shape[0]}, eps={self.eps}"
