"""`--data-parallel-size N`: N engine replicas behind one server, each its own AsyncEngine with its own
executor (worker processes), KV cache and scheduler, in the same event loop.

Each request goes to one replica (`core/dp_router.py`: least loaded, with prefix-cache affinity) and
stays there; aborts follow it. Replica i runs on CUDA devices `i * tp .. i * tp + tp - 1` (on CPU the
cores are shared between every rank of every replica). Statistics reach each stat logger once per
replica, through the logger's per-replica view (`for_engine(i)`, the Prometheus series' `engine`
label) where it has one. A replica whose loop dies takes the others down with it (the engine's fatal
path: every open stream fails, health fails, the server exits non-zero).

Not built with more than one replica, refused at start-up: LoRA adapters and sleep mode (their
state would have to be kept in step across replicas), and the offline `LLM` (as in vLLM, offline
data parallelism is one `LLM` per replica, each given its share of the prompts).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import anyio

from aserve.config import EngineArgs
from aserve.core.dp_router import PrefixAwareRouter, ReplicaLoad
from aserve.core.stats import InflightRequest, SchedulerStats
from aserve.engine.async_engine import AsyncEngine, RequestStream
from aserve.engine.builder import ExecutorFactory
from aserve.engine.stats import StatLogger
from aserve.executor.base import make_executor
from aserve.sampling_params import SamplingParams


_GAUGES = ("num_running_reqs", "num_waiting_reqs", "num_swapped_reqs", "num_used_blocks", "num_total_blocks",
           "num_cached_free_blocks", "num_cpu_blocks", "num_tokens_in_used_blocks")
_COUNTERS = ("prefix_cache_queries", "prefix_cache_hits", "num_preemptions")


def sum_scheduler_stats(views: list[SchedulerStats], fields: tuple[str, ...]) -> SchedulerStats:
    """The `fields` of `views` summed (KV usage recomputed over all blocks; the rest left default)."""
    total = SchedulerStats()
    for view in views:
        for f in fields:
            setattr(total, f, getattr(total, f) + getattr(view, f))
    total.kv_cache_usage = total.num_used_blocks / total.num_total_blocks if total.num_total_blocks else 0.0
    return total


class SummedGauges:
    """Feeds one stat logger that knows nothing of replicas (the stats line, the dashboard): each
    replica's record reaches it with the scheduler gauges summed over every replica's latest view, and
    that replica's own counters and iteration stats (so nothing is counted twice)."""

    def __init__(self, inner: Any, num_replicas: int):
        self.inner = inner
        self.latest = [SchedulerStats() for _ in range(num_replicas)]

    def view(self, index: int) -> _ReplicaView:
        return _ReplicaView(self, index)

    def record(self, index: int, scheduler_stats: SchedulerStats, iteration_stats: Any) -> None:
        self.latest[index] = scheduler_stats
        merged = sum_scheduler_stats(self.latest, _GAUGES)
        for f in _COUNTERS:
            setattr(merged, f, getattr(scheduler_stats, f))
        merged.spec_decoding = scheduler_stats.spec_decoding
        self.inner.record(merged, iteration_stats)


class _ReplicaView:
    """What replica `index` records through (SummedGauges)."""

    def __init__(self, summed: SummedGauges, index: int):
        self.summed = summed
        self.index = index

    def record(self, scheduler_stats: SchedulerStats, iteration_stats: Any) -> None:
        self.summed.record(self.index, scheduler_stats, iteration_stats)


class DataParallelEngine:
    """The AsyncEngine interface the server uses (server/state.py's EngineClient) over replicas."""

    def __init__(self, replicas: list[AsyncEngine]):
        self.replicas = replicas
        first = replicas[0]
        self.config = first.config
        self.model_config = first.model_config
        self.tokenizer = first.tokenizer
        self.router = PrefixAwareRouter(self.config.cache.block_size)

    @classmethod
    def from_engine_args(cls, args: EngineArgs, stat_loggers: list[StatLogger] | None = None,
                         executor_factory: ExecutorFactory = make_executor) -> DataParallelEngine:
        """Builds the replicas one after another (each loads the model); a replica that fails to start
        shuts down the ones already started and raises its error."""
        replicas: list[AsyncEngine] = []
        try:
            for rank in range(args.data_parallel_size):
                replica_args = dataclasses.replace(args, data_parallel_rank=rank)
                replicas.append(AsyncEngine.from_engine_args(replica_args, stat_loggers, executor_factory))
        except BaseException:
            for replica in replicas:
                replica.engine.shutdown()
            raise
        return cls(replicas)

    # -- health and stats -------------------------------------------------------------------------
    def is_healthy(self) -> bool:
        return all(r.is_healthy() for r in self.replicas)

    async def check_health(self) -> None:
        for replica in self.replicas:
            await replica.check_health()

    def add_stat_logger(self, stat_logger: Any) -> None:
        """Every replica records into `stat_logger`: through its per-replica view (`for_engine(i)`)
        where it has one, else through a `SummedGauges` view (the replicas' gauges summed)."""
        for_engine = getattr(stat_logger, "for_engine", None)
        summed = SummedGauges(stat_logger, len(self.replicas)) if for_engine is None else None
        for i, replica in enumerate(self.replicas):
            replica.add_stat_logger(for_engine(i) if for_engine is not None else summed.view(i))

    def get_scheduler_stats(self) -> SchedulerStats:
        """Every replica's live view, summed (KV usage: used over total blocks of all replicas)."""
        return sum_scheduler_stats([r.get_scheduler_stats() for r in self.replicas], _GAUGES + _COUNTERS)

    def inflight_requests(self) -> list[InflightRequest]:
        return sorted((req for r in self.replicas for req in r.inflight_requests()), key=lambda q: q.arrival_time)

    def check_guided_decoding(self, params: SamplingParams) -> None:
        self.replicas[0].check_guided_decoding(params)

    async def reset_prefix_cache(self) -> bool:
        """Every replica forgets its cached prefixes; False if any still holds blocks in use."""
        results = [await r.reset_prefix_cache() for r in self.replicas]
        return all(results)

    @property
    def generation_defaults(self) -> dict:
        return self.replicas[0].generation_defaults

    def queued_load(self, count_tokens: bool = True) -> tuple[int, int]:
        loads = [r.queued_load(count_tokens) for r in self.replicas]
        return sum(n for n, _ in loads), sum(t for _, t in loads)

    # -- requests ---------------------------------------------------------------------------------
    def add_request(self, request_id: str, prompt: str | None, prompt_token_ids: list[int] | None,
                    params: SamplingParams, priority: int = 0, client_id: str | None = None,
                    lora_request: Any = None, trace_headers: dict[str, str] | None = None) -> RequestStream:
        """Routes the request to a replica (`core/dp_router.py`) and queues it there (AsyncEngine.add_request)."""
        loads = [ReplicaLoad(*r.queued_load()) for r in self.replicas]
        rank = self.router.route(prompt_token_ids or [], loads)
        return self.replicas[rank].add_request(request_id, prompt, prompt_token_ids, params, priority, client_id,
                                               lora_request, trace_headers)

    async def abort(self, request_id: str) -> None:
        rank = self.replica_of(request_id)
        if rank is not None:
            await self.replicas[rank].abort(request_id)

    def replica_of(self, request_id: str) -> int | None:
        """The replica serving an open request (None once its stream has closed)."""
        for rank, replica in enumerate(self.replicas):
            if request_id in replica.streams:
                return rank
        return None

    # -- not built with several replicas (refused at start-up) -------------------------------------
    @property
    def loras(self) -> Any:
        return self.replicas[0].loras

    async def add_lora(self, lora_request: Any) -> bool:
        raise ValueError("LoRA adapters are not supported with --data-parallel-size > 1")

    async def remove_lora(self, name: str) -> bool:
        return False

    @property
    def sleep_mode_enabled(self) -> bool:
        return False

    def is_sleeping(self) -> bool:
        return False

    async def sleep(self, level: int = 1) -> None:
        raise ValueError("sleep mode is not supported with --data-parallel-size > 1")

    async def wake_up(self, tags: list[str] | None = None) -> None:
        raise ValueError("sleep mode is not supported with --data-parallel-size > 1")

    # -- the loops --------------------------------------------------------------------------------
    async def run(self, *, task_status=anyio.TASK_STATUS_IGNORED) -> None:
        """Every replica's engine loop in one task group: one dying cancels the others (fatal)."""
        async with anyio.create_task_group() as tg:
            for replica in self.replicas:
                await tg.start(replica.run)
            task_status.started()

    def shutdown(self) -> None:
        for replica in self.replicas:
            replica.shutdown()
