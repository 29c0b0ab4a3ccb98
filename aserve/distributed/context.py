"""`ParallelContext`: this rank's place in the engine's ranks (its tensor-parallel group and its
pipeline stage), handed down explicitly (runner -> loader -> layers); nothing in aserve keeps it in a
global.

Ranks are numbered stage by stage: global rank = pp_rank * tp_size + tp_rank. Each stage's tp_size ranks
form one tensor-parallel group (the layers' collectives); the stages exchange the residual stream
point-to-point over the world group (`runner/pipeline_stage.py`), rank r of one stage with rank r of the
next."""

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
    """`tp_rank` of `tp_size` ranks in stage `pp_rank` of `pp_size`; `group` is the stage's
    tensor-parallel `torch.distributed` process group (None with one rank, where every collective is
    the identity) and `world_group` every rank's (None with one rank); `shm` the shared-memory
    collectives the CPU ranks of one stage on one machine use for tensors that fit (None: every
    collective goes through `group`). `device_index`: the CUDA device this rank runs on, when its host
    chose it (a Ray actor sees only its own GPU, as cuda:0); None: the runner's default (the global
    rank, offset by the data-parallel replica)."""

    tp_rank: int = 0
    tp_size: int = 1
    group: Any = None
    shm: ShmCollectives | None = None
    device_index: int | None = None
    pp_rank: int = 0
    pp_size: int = 1
    world_group: Any = None

    @property
    def is_parallel(self) -> bool:
        """Tensor parallel: this rank holds a slice of each of its layers."""
        return self.tp_size > 1

    @property
    def rank(self) -> int:
        """The global rank."""
        return self.pp_rank * self.tp_size + self.tp_rank

    @property
    def world_size(self) -> int:
        return self.pp_size * self.tp_size

    @property
    def is_first_stage(self) -> bool:
        return self.pp_rank == 0

    @property
    def is_last_stage(self) -> bool:
        return self.pp_rank == self.pp_size - 1

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


def init_distributed(rendezvous: Rendezvous, rank: int, device_index: int | None = None,
                     pp_size: int = 1) -> ParallelContext:
    """Join the group as global `rank` (blocking until every rank arrives, at most `rendezvous.timeout_s`;
    raises RuntimeError / DistStoreError / TimeoutError otherwise); with `pp_size` stages, each stage's
    ranks also form a tensor-parallel subgroup (every rank creates every stage's, in order). On CUDA
    the rank's device is `cuda:<device_index>` (default: its rank; untested). Shared-memory
    collectives only when `rendezvous.same_host`. Returns this rank's context."""
    timeout = datetime.timedelta(seconds=rendezvous.timeout_s)
    if rendezvous.backend == "nccl":
        torch.cuda.set_device(rank if device_index is None else device_index)
    dist.init_process_group(rendezvous.backend, init_method=rendezvous.init_method, rank=rank,
                            world_size=rendezvous.world_size, timeout=timeout)
    tp_size = rendezvous.world_size // pp_size
    pp_rank, tp_rank = divmod(rank, tp_size)
    group = dist.group.WORLD
    if pp_size > 1:
        stage_groups = [dist.new_group(list(range(s * tp_size, (s + 1) * tp_size)), timeout=timeout)
                        for s in range(pp_size)]
        group = stage_groups[pp_rank]
    shm = None
    if tp_size > 1 and rendezvous.same_host and shm_collectives_supported(rendezvous.backend):
        shm = ShmCollectives(tp_rank, tp_size, group, rendezvous.timeout_s, root=pp_rank * tp_size)
    logger.info("rank %d of %d joined: tensor-parallel rank %d of %d, pipeline stage %d of %d (%s%s, %s)", rank,
                rendezvous.world_size, tp_rank, tp_size, pp_rank, pp_size, rendezvous.backend,
                " + shared-memory collectives" if shm is not None else "", rendezvous.init_method)
    return ParallelContext(tp_rank=tp_rank, tp_size=tp_size, group=group if tp_size > 1 else None, shm=shm,
                           device_index=device_index, pp_rank=pp_rank, pp_size=pp_size,
                           world_group=dist.group.WORLD)


def shutdown_distributed() -> None:
    """Leave the group (no-op when none was joined)."""
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()
