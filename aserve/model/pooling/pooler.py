"""Poolers: a packed batch's hidden rows `[T, H]` -> one vector per sequence `[num_seqs, H']` float32
(or, for ALL, one `[len_i, H']` tensor per sequence), as a `PoolerConfig` says.

The batch is described by `query_start_loc` (`[num_seqs + 1]` cumulative row counts, a host list or a
tensor): sequence i owns rows `[query_start_loc[i], query_start_loc[i + 1])` and those rows are its
whole prompt (encoders; a causal embedder's one-step prefill). For a causal embedder under chunked
prefill, pass only the sequences whose last chunk is in this step: LAST needs just that chunk's last
row; MEAN, CLS and ALL need every row of the prompt in one step.

Order of operations, as sentence-transformers and vLLM: pool, then keep the first `dimensions`
values (Matryoshka), then L2-normalize; a classifier's logits get softmax (sigmoid with one label).
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Sequence
from typing import NamedTuple

import torch
import torch.nn.functional as F

from aserve.config.pooler import PoolerConfig, PoolingType


def pool_hidden(hidden: torch.Tensor, query_start_loc: Sequence[int] | torch.Tensor,
                pooling_type: PoolingType) -> torch.Tensor | list[torch.Tensor]:
    """Pool `hidden [T, H]` per sequence in float32: `[num_seqs, H]`, or for ALL a list of `[len_i, H]`."""
    starts = torch.as_tensor(query_start_loc, dtype=torch.int64, device=hidden.device)
    lens = starts[1:] - starts[:-1]
    if pooling_type == PoolingType.CLS:
        return hidden[starts[:-1]].float()
    if pooling_type == PoolingType.LAST:
        return hidden[starts[1:] - 1].float()
    if pooling_type == PoolingType.MEAN:
        seq_of_row = torch.repeat_interleave(torch.arange(lens.numel(), device=hidden.device), lens)
        sums = torch.zeros(lens.numel(), hidden.shape[-1], dtype=torch.float32, device=hidden.device)
        sums.index_add_(0, seq_of_row, hidden[:int(starts[-1])].float())
        return sums / lens.unsqueeze(-1).to(torch.float32)
    if pooling_type == PoolingType.ALL:
        bounds = starts.tolist()
        return [hidden[a:b].float() for a, b in itertools.pairwise(bounds)]
    raise ValueError(f"unknown pooling type {pooling_type!r}")


def _finish(x: torch.Tensor, config: PoolerConfig) -> torch.Tensor:
    if config.dimensions is not None:
        if config.dimensions > x.shape[-1]:
            raise ValueError(f"dimensions={config.dimensions} exceeds the model's {x.shape[-1]}")
        x = x[..., :config.dimensions]
    if config.normalize:
        x = F.normalize(x, p=2, dim=-1)
    return x


class Pooler:
    """Embeddings: `pooler(hidden [T, H], query_start_loc)` -> `[num_seqs, H']` float32 (ALL: a list of
    `[len_i, H']`), pooled, truncated and normalized as `config` (resolved: `pooling_type` set) says."""

    def __init__(self, config: PoolerConfig):
        if config.pooling_type is None:
            raise ValueError("a Pooler needs a resolved PoolerConfig (pooling_type set)")
        self.config = config

    def __call__(self, hidden: torch.Tensor,
                 query_start_loc: Sequence[int] | torch.Tensor) -> torch.Tensor | list[torch.Tensor]:
        pooled = pool_hidden(hidden, query_start_loc, self.config.pooling_type)
        if isinstance(pooled, list):
            return [_finish(rows, self.config) for rows in pooled]
        return _finish(pooled, self.config)


class ClassifierPooler:
    """Cross-encoders / classifiers: `pooler(hidden, query_start_loc)` -> `[num_seqs, num_labels]` float32:
    the rows `config.pooling_type` picks (CLS by default) through `classify` (the model's head, e.g.
    `BertForSequenceClassification.classify`), then softmax over the labels when `config.softmax`
    (sigmoid when there is one label)."""

    def __init__(self, config: PoolerConfig, classify: Callable[[torch.Tensor], torch.Tensor]):
        if config.pooling_type in (None, PoolingType.ALL):
            raise ValueError(f"a classifier needs one row per sequence, not pooling_type {config.pooling_type}")
        self.config = config
        self.classify = classify

    def __call__(self, hidden: torch.Tensor, query_start_loc: Sequence[int] | torch.Tensor) -> torch.Tensor:
        pooled = pool_hidden(hidden, query_start_loc, self.config.pooling_type)
        logits = self.classify(pooled.to(hidden.dtype)).float()
        if self.config.softmax:
            return logits.sigmoid() if logits.shape[-1] == 1 else logits.softmax(-1)
        return logits


def build_pooler(model: torch.nn.Module, config: PoolerConfig) -> Pooler | ClassifierPooler:
    """The pooler for `model` (a `classify` method means a classifier head) under a resolved `config`."""
    classify = getattr(model, "classify", None)
    return ClassifierPooler(config, classify) if callable(classify) else Pooler(config)


class RequestPooling(NamedTuple):
    """One request's overrides of the served pooler config (None: the config's)."""

    dimensions: int | None = None
    normalize: bool | None = None
    activation: bool | None = None  # a classifier's softmax / sigmoid


def pool_requests(hidden: torch.Tensor, query_start_loc: Sequence[int] | torch.Tensor, config: PoolerConfig,
                  overrides: Sequence[RequestPooling],
                  classify: Callable[[torch.Tensor], torch.Tensor] | None = None) -> list[torch.Tensor]:
    """One float32 result per sequence of the packed batch (`Pooler` / `ClassifierPooler` semantics,
    `classify` given for a classifier head), each under `config` with its request's `overrides`.
    A batch without overrides is finished in one vectorized pass."""
    if classify is not None:
        logits = classify(pool_hidden(hidden, query_start_loc, config.pooling_type).to(hidden.dtype)).float()
        out = []
        for row, o in zip(logits, overrides):
            if config.softmax if o.activation is None else o.activation:
                row = row.sigmoid() if row.numel() == 1 else row.softmax(-1)
            out.append(row)
        return out
    pooled = pool_hidden(hidden, query_start_loc, config.pooling_type)
    if all(o == RequestPooling() for o in overrides) and not isinstance(pooled, list):
        return list(_finish(pooled, config).unbind(0))
    rows = pooled if isinstance(pooled, list) else pooled.unbind(0)
    return [_finish(row, PoolerConfig(pooling_type=config.pooling_type,
                                      normalize=config.normalize if o.normalize is None else o.normalize,
                                      dimensions=config.dimensions if o.dimensions is None else o.dimensions))
            for row, o in zip(rows, overrides)]
