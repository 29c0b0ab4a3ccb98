"""Token embedding and the LM head (optionally tied to the embedding).

Under tensor parallelism the loader makes both vocab-parallel (`set_vocab_parallel`): each rank holds
`ceil(vocab / tp)` rows (the last rank's tail is zero padding, so every vocabulary size splits). The
embedding looks up the ids in its range (zero elsewhere) and all-reduces; the LM head computes its
rows' logits and all-gathers them, dropping the padding. A tied head shares the embedding's parameter,
so the embedding's slice is the head's. Position tables (`PositionEmbedding`) stay replicated.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from aserve.distributed.collectives import all_gather_last_dim, all_reduce
from aserve.distributed.context import ParallelContext
from aserve.kernels.cpu_ops import CpuKernels
from aserve.model.layers.greedy_head import MAX_ROWS as GREEDY_MAX_ROWS
from aserve.model.layers.greedy_head import GreedyScreen
from aserve.model.layers.linear import _copy_checked
from aserve.model.quantization.cpu_kernel import kernel_rows
from aserve.model.quantization.cpu_packed import pack_weight, packed_linear


class VocabShard:
    """This rank's rows of a vocab-parallel table: `[start, start + num_rows)` of `vocab_size`, stored
    in `rows_per_rank` rows (the tail past `num_rows` is padding)."""

    def __init__(self, ctx: ParallelContext, vocab_size: int):
        self.ctx = ctx
        self.vocab_size = vocab_size
        self.rows_per_rank = -(-vocab_size // ctx.tp_size)
        self.start = ctx.tp_rank * self.rows_per_rank
        self.num_rows = max(0, min(self.rows_per_rank, vocab_size - self.start))

    def resize(self, param: nn.Parameter) -> None:
        """Give the (possibly shared) parameter this rank's zero-filled slice, in place."""
        param.data = torch.zeros(self.rows_per_rank, param.shape[1], dtype=param.dtype, device=param.device)

    def load(self, param: torch.Tensor, loaded: torch.Tensor) -> None:
        if loaded.shape[0] != self.vocab_size:
            raise ValueError(f"checkpoint tensor has shape {tuple(loaded.shape)}, expected {self.vocab_size} rows")
        _copy_checked(param.data[:self.num_rows], loaded[self.start:self.start + self.num_rows])


class VocabEmbedding(nn.Module):
    """ids `[T]` int64 -> `[T, embedding_dim]`."""

    def __init__(self, num_embeddings: int, embedding_dim: int, dtype: torch.dtype | None = None):
        super().__init__()
        self.num_embeddings = num_embeddings
        self.embedding_dim = embedding_dim
        self.weight = nn.Parameter(torch.empty(num_embeddings, embedding_dim, dtype=dtype), requires_grad=False)
        self.shard: VocabShard | None = None  # vocab-parallel (set by the loader)

    def set_vocab_parallel(self, ctx: ParallelContext) -> None:
        """Hold only this rank's rows (before loading weights; a tied LM head follows, sharing the parameter)."""
        self.shard = VocabShard(ctx, self.num_embeddings)
        self.shard.resize(self.weight)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        shard = self.shard
        if shard is None:
            return F.embedding(input_ids, self.weight)
        local = input_ids - shard.start
        outside = (local < 0) | (local >= shard.num_rows)
        out = F.embedding(local.masked_fill(outside, 0), self.weight)
        return all_reduce(out.masked_fill_(outside.unsqueeze(-1), 0), shard.ctx)

    def load_shard(self, param: torch.Tensor, loaded: torch.Tensor, shard_id: int | None = None) -> None:
        if self.shard is not None:
            self.shard.load(param, loaded)
        else:
            _copy_checked(param.data, loaded)


class PositionEmbedding(VocabEmbedding):
    """Learned absolute positions: positions `[T]` -> rows `positions + offset` of a
    `[max_positions + offset, embedding_dim]` table (OPT's table starts at offset 2; GPT-2's at 0)."""

    def __init__(self, max_positions: int, embedding_dim: int, offset: int = 0, dtype: torch.dtype | None = None):
        super().__init__(max_positions + offset, embedding_dim, dtype)
        self.offset = offset

    def forward(self, positions: torch.Tensor) -> torch.Tensor:
        return F.embedding(positions + self.offset if self.offset else positions, self.weight)


# With AVX512-BF16 the bf16 dot products outrun the 8-bit head's integer products once several rows share the
# weight stream (an estimate: not measured there yet), so larger batches keep the bf16 copy.
Q8_HEAD_MAX_ROWS = 4


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
        self.q8_weight: tuple[torch.Tensor, torch.Tensor] | None = None  # set by `use_q8_weight`
        self.greedy_screen: GreedyScreen | None = None  # the greedy argmax's 8-bit copy (`use_cpu_kernel`)
        self.num_embeddings = num_embeddings
        self.shard: VocabShard | None = None  # vocab-parallel (set by the loader)

    def set_vocab_parallel(self, ctx: ParallelContext) -> None:
        """Compute only this rank's rows of the logits and gather them (before loading weights; a tied
        head's shared parameter is resized by its embedding, not here)."""
        self.shard = VocabShard(ctx, self.num_embeddings)
        if not self.tied:
            self.shard.resize(self.weight)

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
        if self.vnni_weight is not None and self.shard is None and GreedyScreen.fits(kernels, self.weight):
            self.greedy_screen = GreedyScreen(kernels, self.weight.data)

    def greedy(self, hidden: torch.Tensor) -> list[int] | None:
        """Each row's argmax of `self(hidden)` (the first on ties) from the greedy screen (greedy_head.py), or
        None where there is none for this head or these rows (the caller then computes the logits)."""
        if (self.greedy_screen is None or hidden.dim() != 2 or hidden.shape[0] > GREEDY_MAX_ROWS
                or not self.cpu_kernels.accepts(hidden)):  # (the screen exists with vnni_weight, never q8_weight)
            return None
        return self.greedy_screen.argmax(hidden, self.vnni_weight)

    def use_q8_weight(self, kernels: CpuKernels, codes: torch.Tensor, scales: torch.Tensor) -> bool:
        """After loading: multiply bf16 hidden states by 8-bit codes with a scale per 32 (`codes * scales`,
        GGUF's Q8_0: the same weight as the float copy, in half the bytes of bf16) in the C kernel
        `linear_q8`; float32 hidden states keep the float weight. False (nothing changed) where the kernel
        is absent, the shape does not pack, or the vocabulary is sharded."""
        packed = kernels.pack_q8(codes, scales) if kernels.q8_products and self.shard is None else None
        if packed is None:
            return False
        self.cpu_kernels, self.q8_weight = kernels, packed
        self.greedy_screen = None  # (an 8-bit copy of this weight is the head itself now)
        if kernels.packed_isa != "avx512_bf16":  # on AVX2 the 8-bit product is as fast at any batch (README)
            self.vnni_weight = None
        return True

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = self._local_logits(hidden)
        if self.shard is None:
            return logits
        return all_gather_last_dim(logits, self.shard.ctx)[..., :self.num_embeddings]

    def _local_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        kernels = self.cpu_kernels
        if (self.q8_weight is not None and kernels.accepts(hidden) and hidden.dim() == 2
                and (self.vnni_weight is None or hidden.shape[0] <= Q8_HEAD_MAX_ROWS)):
            return kernels.linear_q8(hidden, self.q8_weight)
        if kernels is not None and self.vnni_weight is not None and kernels.accepts(hidden) and hidden.dim() == 2:
            return kernels.linear_vnni(hidden, self.vnni_weight, None, torch.float32)
        if kernels is not None and kernel_rows(kernels, hidden):
            return kernels.linear(hidden, self.weight, None, torch.float32)
        if self.packed_weight is not None:
            return packed_linear(hidden, self.packed_weight, None).float()
        return F.linear(hidden, self.weight).float()

    def load_shard(self, param: torch.Tensor, loaded: torch.Tensor, shard_id: int | None = None) -> None:
        if self.shard is not None:
            self.shard.load(param, loaded)
        else:
            _copy_checked(param.data, loaded)
