"""`ray`: one Ray actor per rank, placed in a placement group on a Ray cluster, so the ranks of one
engine may live on several machines (`ray start --head` on one, `ray start --address=HEAD:6379` on
the others, then `aserve ... --distributed-executor-backend ray`).

The cluster is the one `RAY_ADDRESS` names, the one already initialised in this process, or else
what `ray.init()` finds (a `ray start` cluster of this machine, or a new local one); the connection
this executor made is closed at its shutdown (an external cluster keeps running). Every actor
hosts a `RankWorker` (the same code as the `mp` worker processes) and gets the same msgpack bytes:
every step's SchedulerOutput goes to every rank; the output rank's RunnerOutput (the first rank of the
last pipeline stage) is returned; `submit` / `collect` keep several steps in flight (an actor runs its
calls one at a time, in submission order). The ranks (tp x pp of them) meet in
`torch.distributed` at rank 0's node address and a port free there (gloo on CPU, NCCL on CUDA; each
actor owns one GPU, which it sees as cuda:0); shared-memory collectives only when every rank is on
one node.

Failures: an actor that raises or dies (its node lost, OOM-killed) is fatal: ExecutorDeadError, the
other actors are killed (they may be blocked in a collective). While waiting, the executor polls every
rank's call, so a dead rank is noticed at once, not after its peers' collective timeout. A placement
group the cluster cannot satisfy fails the start-up after `ASERVE_RAY_PLACEMENT_TIMEOUT_S` (default 60).
Multi-step decode's streamed steps arrive with the call's end on this backend (no progress channel).
"""

from __future__ import annotations

import logging
import os
import pickle
import socket
from collections import deque
from typing import Any, NoReturn

import msgspec

from aserve.config import AserveConfig
from aserve.core.batch import RunnerInfo, RunnerOutput, SchedulerOutput
from aserve.distributed.rendezvous import DEFAULT_TIMEOUT_S, Rendezvous
from aserve.executor.base import ExecutorDeadError
from aserve.executor.rank_worker import LoRAReply, RankWorker, output_rank
from aserve.lora.errors import LoRAAdapterError
from aserve.lora.request import LoRARequest

logger = logging.getLogger(__name__)
_encoder = msgspec.msgpack.Encoder()
_decode_ro = msgspec.msgpack.Decoder(RunnerOutput)
_decode_info = msgspec.msgpack.Decoder(RunnerInfo)
_PLACEMENT_TIMEOUT_S = float(os.environ.get("ASERVE_RAY_PLACEMENT_TIMEOUT_S", "60"))


class RayRankActor:
    """The actor class (wrapped by `ray.remote` at start-up): a RankWorker behind Ray method calls."""

    def __init__(self, config_bytes: bytes, rank: int):
        config: AserveConfig = pickle.loads(config_bytes)
        if config.device.device == "cpu":
            # Ray sets OMP_NUM_THREADS to the actor's 1 CPU; the rank's share of the cores is limit_threads'
            os.environ.pop("OMP_NUM_THREADS", None)
        logging.basicConfig(level=os.environ.get("ASERVE_LOG_LEVEL", "INFO"),
                            format=f"%(levelname)s %(asctime)s [ray rank {rank}] %(name)s: %(message)s")
        self.config = config
        self.rank = rank
        self.worker: RankWorker | None = None

    def address(self) -> tuple[str, int]:
        """This node's IP and a TCP port free on it now (rank 0's: the rendezvous)."""
        import ray

        host = ray.util.get_node_ip_address()
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            s.bind(("", 0))
            return host, s.getsockname()[1]

    def start(self, rendezvous: Rendezvous | None) -> bytes:
        self.worker = RankWorker(self.config, self.rank, rendezvous)
        return self.worker.start(device_index=0 if self.config.device.device == "cuda" else None)

    def execute(self, body: bytes) -> bytes:
        return self.worker.execute(body)

    def add_lora(self, body: bytes) -> LoRAReply:
        return self.worker.add_lora(body)

    def remove_lora(self, lora_int_id: int) -> LoRAReply:
        return self.worker.remove_lora(lora_int_id)

    def sleep(self, level: int) -> None:
        self.worker.sleep(level)

    def wake_up(self, body: bytes) -> None:
        self.worker.wake_up(body)

    def shutdown(self) -> None:
        if self.worker is not None:
            self.worker.shutdown()


class RayExecutor:
    name = "ray"

    def __init__(self, config: AserveConfig):
        self.config = config
        self.world_size = config.parallel.world_size
        self.output_rank = output_rank(config)
        self._submitted: deque[list] = deque()  # each submitted step's calls, oldest first
        self._actors: list[Any] = []
        self._placement_group = None
        self._started_ray = False
        self._dead: str | None = None

    def start(self) -> RunnerInfo:
        """Places one actor per rank and starts them; the output rank's RunnerInfo. ExecutorDeadError (with the
        failing rank's error) if the cluster cannot place them or any rank fails; nothing is left behind."""
        try:
            import ray
            from ray.util.placement_group import placement_group
            from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy
        except ImportError:
            raise ExecutorDeadError("--distributed-executor-backend ray needs Ray: pip install 'aserve[ray]'") from None
        if not ray.is_initialized():
            address = os.environ.get("RAY_ADDRESS") or None
            ray.init(address=address, include_dashboard=False, log_to_driver=True, ignore_reinit_error=True)
            self._started_ray = address is None
        cuda = self.config.device.device == "cuda"
        bundles = [{"GPU": 1.0, "CPU": 1.0} if cuda else {"CPU": 1.0} for _ in range(self.world_size)]
        self._placement_group = placement_group(bundles, strategy="PACK")
        ready, _ = ray.wait([self._placement_group.ready()], timeout=_PLACEMENT_TIMEOUT_S)
        if not ready:
            self._fail(f"the Ray cluster cannot place {self.world_size} ranks ({bundles[0]} each) within "
                       f"{_PLACEMENT_TIMEOUT_S:.0f} s: {ray.cluster_resources()} in the cluster")
        actor_cls = ray.remote(num_cpus=1, num_gpus=1 if cuda else 0, max_restarts=0)(RayRankActor)
        config_bytes = pickle.dumps(self.config)
        self._actors = [
            actor_cls.options(scheduling_strategy=PlacementGroupSchedulingStrategy(
                self._placement_group, placement_group_bundle_index=rank)).remote(config_bytes, rank)
            for rank in range(self.world_size)]
        rendezvous = None
        if self.world_size > 1:
            addresses = self._gather([a.address.remote() for a in self._actors])
            host, port = addresses[0]
            rendezvous = Rendezvous(host, port, self.world_size, "nccl" if cuda else "gloo", DEFAULT_TIMEOUT_S,
                                    same_host=len({h for h, _ in addresses}) == 1)
            logger.info("Started %d Ray ranks on %d node(s) (%s at %s)", self.world_size,
                        len({h for h, _ in addresses}), rendezvous.backend, rendezvous.init_method)
        infos = self._gather([a.start.remote(rendezvous) for a in self._actors])
        return _decode_info.decode(infos[self.output_rank])

    def _gather(self, refs: list) -> list:
        """Every rank's result, in rank order; the first failure (an error raised, an actor dead) is
        fatal at once, without waiting for the others."""
        import ray

        if self._dead is not None:
            raise ExecutorDeadError(self._dead)
        pending = list(refs)
        while pending:
            done, pending = ray.wait(pending, num_returns=1)
            try:
                ray.get(done[0])
            except Exception as exc:  # noqa: BLE001 - RayTaskError / RayActorError / OOM: the rank is gone
                self._fail(f"Ray rank {refs.index(done[0])} failed: {exc}", exc)
        return ray.get(refs)

    def _fail(self, message: str, cause: BaseException | None = None) -> NoReturn:
        self._dead = message
        self._release()
        raise ExecutorDeadError(message) from cause

    def _release(self) -> None:
        """Kills the actors and removes the placement group (best effort: another executor of this
        process, a data-parallel replica, may have closed the connection already), then closes the
        connection this executor opened."""
        import ray

        actors, self._actors = self._actors, []
        group, self._placement_group = self._placement_group, None
        if ray.is_initialized():
            for actor in actors:
                try:
                    ray.kill(actor, no_restart=True)
                except Exception:  # noqa: BLE001 - already gone
                    pass
            if group is not None:
                from ray.util.placement_group import remove_placement_group

                try:
                    remove_placement_group(group)
                except Exception:  # noqa: BLE001 - already removed
                    pass
        if self._started_ray and ray.is_initialized():
            ray.shutdown()
        self._started_ray = False

    def execute(self, scheduler_output: SchedulerOutput, on_progress=None) -> RunnerOutput:
        self.submit(scheduler_output)
        return self.collect()

    def submit(self, scheduler_output: SchedulerOutput) -> None:
        """Starts a step on every rank without waiting for it; `collect` returns its output."""
        if self._dead is not None:
            raise ExecutorDeadError(self._dead)
        body = _encoder.encode(scheduler_output)
        self._submitted.append([a.execute.remote(body) for a in self._actors])

    def collect(self) -> RunnerOutput:
        """The oldest submitted step's output (blocking)."""
        return _decode_ro.decode(self._gather(self._submitted.popleft())[self.output_rank])

    def reply_fileno(self) -> None:
        return None

    def add_lora(self, lora_request: LoRARequest) -> None:
        body = _encoder.encode(lora_request)
        self._adapter_replies([a.add_lora.remote(body) for a in self._actors])

    def remove_lora(self, lora_int_id: int) -> bool:
        return self._adapter_replies([a.remove_lora.remote(int(lora_int_id)) for a in self._actors])[0].ok

    def _adapter_replies(self, refs: list) -> list[LoRAReply]:
        replies = self._gather(refs)
        refused = [r for r in replies if r.error is not None]
        if refused:
            raise LoRAAdapterError(refused[0].error)
        return replies

    def sleep(self, level: int) -> None:
        self._gather([a.sleep.remote(int(level)) for a in self._actors])

    def wake_up(self, tags: tuple[str, ...] | None = None) -> None:
        body = _encoder.encode(None if tags is None else list(tags))
        self._gather([a.wake_up.remote(body) for a in self._actors])

    def shutdown(self) -> None:
        if not self._actors and self._placement_group is None:
            return
        import ray

        if self._dead is None and self._actors and ray.is_initialized():
            try:
                ray.get([a.shutdown.remote() for a in self._actors], timeout=30)
            except Exception:  # noqa: BLE001 - shutting down anyway
                logger.warning("a Ray rank did not leave its process group cleanly")
        self._release()
