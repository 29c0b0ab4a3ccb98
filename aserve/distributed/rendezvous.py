"""Where the tensor-parallel ranks of one engine meet: plain data the executor picks and hands to every
worker (standard library only: the executor's process never imports torch for this)."""

from __future__ import annotations

import os
import socket
from dataclasses import dataclass

# Seconds a rank waits for the others at the rendezvous and in any collective before it fails
# (a rank that never arrives fails the start-up with an error instead of a hang).
DEFAULT_TIMEOUT_S = float(os.environ.get("ASERVE_DIST_TIMEOUT_S", "120"))


@dataclass(frozen=True)
class Rendezvous:
    """`torch.distributed` init for `world_size` ranks: TCP store at `host:port`, `backend` ("gloo" on
    CPU, "nccl" on CUDA), `timeout_s` for the store and every collective; `same_host`: every rank
    runs on this one machine (shared-memory collectives are possible)."""

    host: str
    port: int
    world_size: int
    backend: str
    timeout_s: float = DEFAULT_TIMEOUT_S
    same_host: bool = True

    @property
    def init_method(self) -> str:
        return f"tcp://{self.host}:{self.port}"


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port nothing listens on right now (the OS picks it; another process could take it before
    rank 0 binds it, in which case the rendezvous fails with an error, never a hang)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def local_rendezvous(world_size: int, device: str, timeout_s: float = DEFAULT_TIMEOUT_S) -> Rendezvous:
    """One node: a free localhost port; gloo on CPU, NCCL on CUDA (NCCL is untested: no multi-GPU
    machine was available; see the README's "Scaling out")."""
    return Rendezvous("127.0.0.1", free_port(), world_size, "nccl" if device == "cuda" else "gloo", timeout_s)
