"""The collectives tensor-parallel layers call; each is the identity with one rank (no cost at tp=1).

Every rank must call the same collectives in the same order (they run the same step on the same
batch, so they do). CPU ranks on one x86 machine exchange tensors that fit through shared memory
(`shm.py`), the rest through the process group (gloo / NCCL)."""

from __future__ import annotations

import torch
import torch.distributed as dist

from aserve.distributed.context import ParallelContext


def all_reduce(x: torch.Tensor, ctx: ParallelContext) -> torch.Tensor:
    """The sum of `x` over the ranks, in place (returns `x`)."""
    if ctx.tp_size == 1:
        return x
    if not x.is_contiguous():
        x = x.contiguous()
    if ctx.shm is not None and ctx.shm.fits(x):
        return ctx.shm.all_reduce(x)
    dist.all_reduce(x, group=ctx.group)
    return x


def all_gather_last_dim(x: torch.Tensor, ctx: ParallelContext) -> torch.Tensor:
    """The ranks' `x [..., n]` concatenated in rank order along the last dim: `[..., tp_size * n]`."""
    if ctx.tp_size == 1:
        return x
    x = x.contiguous()
    if ctx.shm is not None and ctx.shm.fits(x):
        return ctx.shm.all_gather_last_dim(x)
    parts = [torch.empty_like(x) for _ in range(ctx.tp_size)]
    dist.all_gather(parts, x, group=ctx.group)
    return torch.cat(parts, dim=-1)


def all_reduce_min(value: int, ctx: ParallelContext) -> int:
    """The smallest of every rank's `value` (all stages: start-up agreements such as the KV block count)."""
    if ctx.world_size == 1:
        return value
    t = torch.tensor([value], dtype=torch.int64)
    if dist.get_backend(ctx.world_group) == "nccl":
        t = t.cuda()
    dist.all_reduce(t, op=dist.ReduceOp.MIN, group=ctx.world_group)
    return int(t.item())


def in_waves(work, ctx: ParallelContext, max_at_once: int | None, barrier=None) -> None:
    """Run `work()` on every rank, at most `max_at_once` ranks at a time (`--max-parallel-loading-workers`):
    global rank r runs in wave `r // max_at_once`, and every rank waits at a barrier after each wave (all
    ranks must call this together). None, or one rank: just `work()`. `barrier` defaults to the world's."""
    if ctx.world_size == 1 or max_at_once is None or max_at_once >= ctx.world_size:
        work()
        return
    if barrier is None:
        def barrier() -> None:
            dist.barrier(group=ctx.world_group)
    for wave in range(-(-ctx.world_size // max_at_once)):
        if ctx.rank // max_at_once == wave:
            work()
        barrier()
