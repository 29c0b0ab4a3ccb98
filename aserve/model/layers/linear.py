"""Dense linear layers. Fused projections (qkv, gate/up) are one `MergedLinear` whose shards are
filled by the weight loader, so model code only composes layers."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class Linear(nn.Module):
    """`y = x @ weight.T (+ bias)`; weight `[output_size, input_size]` as in Hugging Face checkpoints."""

    def __init__(self, input_size: int, output_size: int, bias: bool = False, dtype: torch.dtype | None = None):
        super().__init__()
        self.input_size = input_size
        self.output_size = output_size
        self.weight = nn.Parameter(torch.empty(output_size, input_size, dtype=dtype), requires_grad=False)
        self.bias = nn.Parameter(torch.empty(output_size, dtype=dtype), requires_grad=False) if bias else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight, self.bias)

    def load_shard(self, param: torch.Tensor, loaded: torch.Tensor, shard_id: int | None = None) -> None:
        """Copy a whole checkpoint tensor into `param` (`shard_id` must be None for an unfused layer)."""
        if shard_id is not None:
            raise ValueError(f"{type(self).__name__} is not fused; got shard {shard_id}")
        _copy_checked(param.data, loaded)

    def extra_repr(self) -> str:
        return f"in={self.input_size}, out={self.output_size}, bias={self.bias is not None}"


class MergedLinear(Linear):
    """Several projections of the same input stacked along the output dim (e.g. q|k|v, gate|up).

    Shard `i` owns output rows `[offsets[i], offsets[i] + output_sizes[i])`.
    """

    def __init__(self, input_size: int, output_sizes: list[int], bias: bool = False,
                 dtype: torch.dtype | None = None):
        super().__init__(input_size, sum(output_sizes), bias, dtype)
        self.output_sizes = list(output_sizes)
        self.offsets = [sum(output_sizes[:i]) for i in range(len(output_sizes))]

    def load_shard(self, param: torch.Tensor, loaded: torch.Tensor, shard_id: int | None = None) -> None:
        if shard_id is None:  # an already-fused checkpoint tensor
            _copy_checked(param.data, loaded)
            return
        size = self.output_sizes[shard_id]
        _copy_checked(param.data.narrow(0, self.offsets[shard_id], size), loaded)

    def split(self, y: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """Split an output `[..., sum(output_sizes)]` into the per-shard outputs (views)."""
        return y.split(self.output_sizes, dim=-1)


def _copy_checked(dst: torch.Tensor, src: torch.Tensor) -> None:
    if tuple(dst.shape) != tuple(src.shape):
        raise ValueError(f"checkpoint tensor has shape {tuple(src.shape)}, expected {tuple(dst.shape)}")
    dst.copy_(src)
