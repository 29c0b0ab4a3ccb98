"""`ParallelContext`: this rank's place in the tensor-parallel group, handed down explicitly (runner ->
loader -> layers); nothing in aserve keeps it in a global."""

from __future__ import annotations

import dataclasses
import datetime
import logging
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from aserve.distributed.rendezvous import Rendezvous
from aserve.distributed.shm import ShmCollectives, shm_collectives_supported

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class ParallelContext:
    """`tp_rank` of `tp_size` ranks; `group` is the `torch.distributed` process group (None with one
    rank, where every collective is the identity); `shm` the shared-memory collectives the CPU ranks
    of one machine use for tensors that fit (None: every collective goes through `group`).
    `device_index`: the CUDA device this rank runs on, when its host chose it (a Ray actor sees only
    its own GPU, as cuda:0); None: the runner's default (rank, offset by the data-parallel replica)."""

    tp_rank: int = 0
    tp_size: int = 1
    group: Any = None
    shm: ShmCollectives | None = None
    device_index: int | None = None

    @property
    def is_parallel(self) -> bool:
        return self.tp_size > 1

    def with_device(self, device_index: int | None) -> ParallelContext:
        return self if device_index is None else dataclasses.replace(self, device_index=device_index)


SINGLE = ParallelContext()


def shard_along(t: torch.Tensor, dim: int, ctx: ParallelContext, replicas: int = 1) -> torch.Tensor:
    """This rank's slice of a checkpoint tensor split evenly along `dim` into `tp_size / replicas`
    pieces (`replicas` consecutive ranks share a piece: KV heads replicated when there are fewer KV
    heads than ranks). Raises ValueError when `dim` does not divide."""
    pieces = ctx.tp_size // replicas
    full = t.shape[dim]
    if full % pieces:
        raise ValueError(f"checkpoint tensor has {full} along dim {dim}, which does not split into {pieces} "
                         f"tensor-parallel pieces")
    local = full // pieces
    return t.narrow(dim, (ctx.tp_rank // replicas) * local, local)


def init_distributed(rendezvous: Rendezvous, rank: int, device_index: int | None = None) -> ParallelContext:
    """Join the group (blocking until every rank arrives, at most `rendezvous.timeout_s`; raises
    RuntimeError / DistStoreError / TimeoutError otherwise). On CUDA the rank's device is
    `cuda:<device_index>` (default: its rank; untested). Shared-memory collectives only when
    `rendezvous.same_host`. Returns this rank's context."""
    timeout = datetime.timedelta(seconds=rendezvous.timeout_s)
    if rendezvous.backend == "nccl":
        torch.cuda.set_device(rank if device_index is None else device_index)
    dist.init_process_group(rendezvous.backend, init_method=rendezvous.init_method, rank=rank,
                            world_size=rendezvous.world_size, timeout=timeout)
    group = dist.group.WORLD
    shm = None
    if rendezvous.same_host and shm_collectives_supported(rendezvous.backend):
        shm = ShmCollectives(rank, rendezvous.world_size, group, rendezvous.timeout_s)
    logger.info("tensor-parallel rank %d of %d joined (%s%s, %s)", rank, rendezvous.world_size, rendezvous.backend,
                " + shared-memory collectives" if shm is not None else "", rendezvous.init_method)
    return ParallelContext(tp_rank=rank, tp_size=rendezvous.world_size, group=group, shm=shm,
                           device_index=device_index)


def shutdown_distributed() -> None:
    """Leave the group (no-op when none was joined)."""
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()
