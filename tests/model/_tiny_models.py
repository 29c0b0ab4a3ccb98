"""Test helper: our model loaded from a tiny Hugging Face folder (tests/support/tiny_models.py builds it), plus a driver that runs a schedule of chunks through the paged model."""

from __future__ import annotations

import random
from pathlib import Path

import torch

from aserve.config import AserveConfig, EngineArgs
from aserve.model.attention.torch_backend import TorchAttentionBackend
from aserve.model.loader import load_model
from tests.model._paged_batch import PagedBatch


def engine_config(path: Path, dtype: str = "float32", **kwargs) -> AserveConfig:
    return EngineArgs(model=str(path), dtype=dtype, **kwargs).create_config()


def load_ours(path: Path, dtype: str = "float32", **kwargs) -> torch.nn.Module:
    return load_model(engine_config(path, dtype, **kwargs), TorchAttentionBackend(), "cpu")


def hf_logits(hf_model: torch.nn.Module, tokens: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return hf_model(torch.tensor([tokens])).logits[0].float()


def run_schedule(model, prompts: list[list[int]], steps: list[list[tuple[int, int]]], block_size: int,
                 num_blocks: int = 64, seed: int = 0) -> list[torch.Tensor]:
    """Run `steps` (each a list of (seq index, num tokens)) through `model` over a paged cache, with
    query-length-1 chunks moved first as the runner does; return each sequence's logits for every
    position computed, in position order."""
    arch = model.arch
    batch = PagedBatch(arch.num_hidden_layers, arch.num_key_value_heads, arch.head_dim, block_size, num_blocks,
                       dtype=model.dtype, seed=seed)
    model.bind_kv_caches(batch.kv_caches)
    done = [0] * len(prompts)
    out: list[list[torch.Tensor]] = [[] for _ in prompts]
    with torch.no_grad():
        for step in steps:
            chunks = []
            for seq, n in sorted(step, key=lambda c: c[1] != 1):
                chunks.append((seq, prompts[seq][done[seq]:done[seq] + n]))
                done[seq] += n
            input_ids, positions, meta = batch.step(chunks)
            logits = model.compute_logits(model(input_ids, positions, meta))
            for i, (seq, _) in enumerate(chunks):
                out[seq].append(logits[meta.query_start_loc_cpu[i]:meta.query_start_loc_cpu[i + 1]])
    assert done == [len(p) for p in prompts], "schedule must cover every prompt exactly"
    return [torch.cat(parts) for parts in out]


def random_schedule(lengths: list[int], seed: int, max_chunk: int = 12) -> list[list[tuple[int, int]]]:
    """Random steps mixing decodes (1 token) and chunks, sequences joining at different steps."""
    rng = random.Random(seed)
    done = [0] * len(lengths)
    steps = []
    while any(d < n for d, n in zip(done, lengths, strict=True)):
        active = [i for i, (d, n) in enumerate(zip(done, lengths, strict=True)) if d < n]
        chosen = rng.sample(active, rng.randint(1, len(active)))
        step = []
        for i in chosen:
            remaining = lengths[i] - done[i]
            n = 1 if (done[i] > 0 and rng.random() < 0.5) else rng.randint(1, min(remaining, max_chunk))
            step.append((i, n))
            done[i] += n
        step.sort(key=lambda c: c[1] != 1)  # decodes (query length 1) first
        steps.append(step)
    return steps
