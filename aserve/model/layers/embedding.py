"""Token embedding and the LM head (optionally tied to the embedding)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from aserve.model.layers.linear import _copy_checked
from aserve.kernels.cpu_ops import CpuKernels
from aserve.model.quantization.cpu_kernel import kernel_rows
from aserve.model.quantization.cpu_packed import pack_weight, packed_linear


class VocabEmbedding(nn.Module):
    """ids `[T]` int64 -> `[T, embedding_dim]`."""

    def __init__(self, num_embeddings: int, embedding_dim: int, dtype: torch.dtype | None = None):
        super().__init__()
        self.num_embeddings = num_embeddings
        self.embedding_dim = embedding_dim
        self.weight = nn.Parameter(torch.empty(num_embeddings, embedding_dim, dtype=dtype), requires_grad=False)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return F.embedding(input_ids, self.weight)

    def load_shard(self, param: torch.Tensor, loaded: torch.Tensor, shard_id: int | None = None) -> None:
        _copy_checked(param.data, loaded)


class PositionEmbedding(VocabEmbedding):
    """Learned absolute positions: positions `[T]` -> rows `positions + offset` of a
    `[max_positions + offset, embedding_dim]` table (OPT's table starts at offset 2; GPT-2's at 0)."""

    def __init__(self, max_positions: int, embedding_dim: int, offset: int = 0, dtype: torch.dtype | None = None):
        super().__init__(max_positions + offset, embedding_dim, dtype)
        self.offset = offset

    def forward(self, positions: torch.Tensor) -> torch.Tensor:
        return F.embedding(positions + self.offset if self.offset else positions, self.weight)


class LMHead(nn.Module):
    """hidden `[N, hidden]` -> logits `[N, vocab]` in float32. `tie_to` shares the embedding's weight."""

    def __init__(self, num_embeddings: int, embedding_dim: int, dtype: torch.dtype | None = None,
                 tie_to: VocabEmbedding | None = None):
        super().__init__()
        self.tied = tie_to is not None
        if tie_to is not None:
            self.weight = tie_to.weight
        else:
            self.weight = nn.Parameter(torch.empty(num_embeddings, embedding_dim, dtype=dtype), requires_grad=False)

        self.packed_weight: torch.Tensor | None = None  # the CPU form, from `pack_for_cpu`
        self.cpu_kernels: CpuKernels | None = None  # set by `use_cpu_kernel`
        self.vnni_weight: torch.Tensor | None = None  # its packed copy of the weight, when the shape packs

    def pack_for_cpu(self) -> None:
        """After loading: multiply by a oneDNN-packed copy of the weight (aserve/model/quantization/
        cpu_packed.py; a tied head keeps the embedding's weight for lookups, so this is a copy)."""
        self.packed_weight = pack_weight(self.weight.data)

    def use_cpu_kernel(self, kernels: CpuKernels) -> None:
        """After loading: multiply in aserve's C kernels (aserve/model/quantization/cpu_kernel.py) by a
        packed copy of the weight (a tied head keeps the embedding's for lookups), straight into float32
        logits (no bf16 rounding of the logits)."""
        self.cpu_kernels = kernels
        self.vnni_weight = kernels.pack_vnni(self.weight.data)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        kernels = self.cpu_kernels
        if kernels is not None and self.vnni_weight is not None and kernels.accepts(hidden) and hidden.dim() == 2:
            return kernels.linear_vnni(hidden, self.vnni_weight, None, torch.float32)
        if kernels is not None and kernel_rows(kernels, hidden):
            return kernels.linear(hidden, self.weight, None, torch.float32)
        if self.packed_weight is not None:
            return packed_linear(hidden, self.packed_weight, None).float()
        return F.linear(hidden, self.weight).float()

    def load_shard(self, param: torch.Tensor, loaded: torch.Tensor, shard_id: int | None = None) -> None:
        _copy_checked(param.data, loaded)
