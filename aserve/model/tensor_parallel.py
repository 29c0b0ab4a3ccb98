"""Tensor parallelism applied to a built model from outside (the loader calls this; model files only
compose layers and declare which of their Linear layers are column- or row-parallel).

The model was built from this rank's `ArchConfig` (aserve/config/parallel.py), so its layers already
have this rank's sizes; `apply_tensor_parallel` gives each its form before the weights load, and the
layers' `load_shard` then narrows every checkpoint tensor to this rank's slice:

- Linear layers named in the model's `column_parallel_modules` split their output rows (merged layers
  part by part; the `qkv_modules` ones replicate k and v when there are fewer KV heads than ranks);
  those in `row_parallel_modules` split their input columns and all-reduce their outputs; any other
  Linear (routers, OPT's project_in/out) is replicated.
- Token embeddings (not position tables) and the LM head are vocab-parallel.
- MoE expert layers split every expert's intermediate dim and all-reduce their output.
"""

from __future__ import annotations

import logging
from collections import Counter

from torch import nn

from aserve.distributed.context import ParallelContext
from aserve.model.layers.embedding import LMHead, PositionEmbedding, VocabEmbedding
from aserve.model.layers.linear import COLUMN, ROW, Linear, MergedLinear
from aserve.model.layers.moe import FusedMoE

logger = logging.getLogger(__name__)


def apply_tensor_parallel(model: nn.Module, ctx: ParallelContext, kv_replicas: int = 1) -> dict[str, int]:
    """Give every layer of `model` its tensor-parallel form for `ctx` (nothing with one rank);
    `kv_replicas` ranks share each KV head. Returns how many layers took each form. Raises ValueError
    for a plan the layers cannot take (a merged layer named row-parallel)."""
    counts: Counter[str] = Counter()
    if not ctx.is_parallel:
        return dict(counts)
    column = set(getattr(model, "column_parallel_modules", ()))
    row = set(getattr(model, "row_parallel_modules", ()))
    qkv = set(getattr(model, "qkv_modules", ()))
    for name, module in model.named_modules():
        short = name.rsplit(".", 1)[-1]
        if isinstance(module, Linear):
            if short in column and isinstance(module, MergedLinear):
                replicas = (1, kv_replicas, kv_replicas) if short in qkv and len(module.output_sizes) == 3 else None
                module.set_tensor_parallel(ctx, COLUMN, replicas)
                counts[COLUMN] += 1
            elif short in column or short in row:
                module.set_tensor_parallel(ctx, COLUMN if short in column else ROW)
                counts[COLUMN if short in column else ROW] += 1
            else:
                counts["replicated"] += 1
        elif isinstance(module, (VocabEmbedding, LMHead)) and not isinstance(module, PositionEmbedding):
            module.set_vocab_parallel(ctx)
            counts["vocab"] += 1
        elif isinstance(module, FusedMoE):
            module.set_tensor_parallel(ctx)
            counts["experts"] += 1
    logger.info("tensor parallel rank %d of %d: %s", ctx.tp_rank, ctx.tp_size,
                ", ".join(f"{form} x{n}" for form, n in sorted(counts.items())))
    return dict(counts)
