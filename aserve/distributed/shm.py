"""All-reduce and all-gather through shared memory for ranks on one x86 CPU (what gloo costs in a decode
step made this worth having: see the README's "Scaling out").

gloo hands every collective to its worker and transport threads and back over loopback TCP: about
0.3 ms alone, but 1.5-10 ms inside a step, where those thread hand-offs compete with the ranks'
compute for the cores (measured on 2 cores: 33 collectives took ~57 of a 130 ms TP=2 decode step).
Here each rank copies its tensor into its own slot of one shared mapping, publishes a call counter,
spins until every rank's counter has reached the same call, and reads the others' slots directly;
no thread, no system call. Every rank sums the slots in rank order, so all ranks hold bitwise the same
result (as they do with gloo).

Correctness rests on x86's ordering of plain stores (a rank's slot is written before its counter) and
of loads (a counter is read before the slots), so the path is used on x86-64 only. Slots come in two
sets used alternately: a rank can only reuse a set after every rank has published the call after it,
i.e. has finished reading it. Tensors larger than a slot go to gloo (prefill-sized steps, where its
fixed cost is small against the compute). A peer that never arrives raises after the timeout (the
executor kills the ranks as soon as one dies, so this is a backstop).
"""

from __future__ import annotations

import mmap
import os
import platform
import tempfile
import time

import numpy as np
import torch
import torch.distributed as dist

SLOT_BYTES = 4 << 20  # per rank and slot set: decode-sized activations and logits
_COUNTER_STRIDE = 8  # int64s per rank counter: one 64-byte cache line each
_SPINS_BEFORE_YIELD = 2000


def shm_collectives_supported(backend: str) -> bool:
    """Whether `ShmCollectives` may serve this group: gloo (CPU) ranks on an x86-64 host, unless
    ASERVE_CPU_SHM_COLLECTIVES=0."""
    return (backend == "gloo" and platform.machine().lower() in ("x86_64", "amd64")
            and os.environ.get("ASERVE_CPU_SHM_COLLECTIVES", "1") != "0")


class ShmCollectives:
    """One mapping shared by the `world_size` ranks of `group` (created by its rank 0, global rank
    `root`, under /dev/shm, unlinked once every rank has mapped it, so nothing is left behind).
    Collective: every rank must construct it, and then call the same operations in the same order."""

    def __init__(self, rank: int, world_size: int, group, timeout_s: float, root: int = 0):
        self.rank, self.world_size, self.timeout_s = rank, world_size, timeout_s
        header = world_size * _COUNTER_STRIDE * 8
        size = header + 2 * world_size * SLOT_BYTES
        path = [None]
        if rank == 0:
            folder = "/dev/shm" if os.path.isdir("/dev/shm") else tempfile.gettempdir()
            fd, path[0] = tempfile.mkstemp(prefix="aserve-tp-", dir=folder)
            os.ftruncate(fd, size)
            os.close(fd)
        dist.broadcast_object_list(path, src=root, group=group)
        with open(path[0], "r+b") as f:
            self._map = mmap.mmap(f.fileno(), size)
        dist.barrier(group=group)
        if rank == 0:
            os.unlink(path[0])
        self._counters = np.ndarray((world_size, _COUNTER_STRIDE), dtype=np.int64, buffer=self._map)
        self._slots = torch.frombuffer(self._map, dtype=torch.uint8, offset=header, count=size - header
                                       ).view(2, world_size, SLOT_BYTES)
        self._calls = 0

    def fits(self, x: torch.Tensor) -> bool:
        return x.is_cpu and x.numel() * x.element_size() <= SLOT_BYTES

    def _exchange(self, x: torch.Tensor) -> list[torch.Tensor]:
        """Publish `x` and return every rank's copy of this call's tensor (views into the mapping)."""
        self._calls += 1
        nbytes = x.numel() * x.element_size()
        slots = self._slots[self._calls % 2]
        slots[self.rank, :nbytes].copy_(x.contiguous().view(-1).view(torch.uint8))
        self._counters[self.rank, 0] = self._calls
        counters, spins, deadline = self._counters[:, 0], 0, None
        while counters.min() < self._calls:
            spins += 1
            if spins % _SPINS_BEFORE_YIELD == 0:
                os.sched_yield()  # more ranks than cores: let the one we wait for run
                deadline = deadline or time.monotonic() + self.timeout_s
                if time.monotonic() > deadline:
                    raise TimeoutError(f"tensor-parallel rank {self.rank}: no peer reached collective "
                                       f"{self._calls} within {self.timeout_s:.0f}s")
        return [slots[r, :nbytes].view(x.dtype).view(x.shape) for r in range(self.world_size)]

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """The ranks' sum of `x`, written into `x` (summed in rank order on every rank)."""
        parts = self._exchange(x)
        torch.add(parts[0], parts[1], out=x)
        for part in parts[2:]:
            x.add_(part)
        return x

    def all_gather_last_dim(self, x: torch.Tensor) -> torch.Tensor:
        return torch.cat(self._exchange(x), dim=-1)
