"""Builds the scheduler's `SchedulerStats` after a step: gauges read now, counters as deltas since
the previous consuming call."""

from __future__ import annotations

from typing import TYPE_CHECKING

from aserve.core.lora_slots import adapter_names
from aserve.core.stats import SchedulerStats

if TYPE_CHECKING:
    from aserve.core.scheduler import Scheduler


class StatsReporter:
    """Remembers the cumulative counters at the last consuming `make` (one per scheduler)."""

    def __init__(self) -> None:
        self._reported = (0, 0, 0)  # prefix-cache queries, hits, preemptions

    def make(self, scheduler: Scheduler, consume: bool) -> SchedulerStats:
        kv = scheduler.kv_cache_manager
        bs = scheduler.block_size
        running = scheduler.running
        num_tokens = 0
        for req in running:
            num_tokens += min(req.num_computed_tokens, len(kv.get_block_ids(req.request_id)) * bs)
        queries, hits, preemptions = kv.prefix_cache_queries, kv.prefix_cache_hits, scheduler.num_preemptions
        stats = SchedulerStats(
            num_running_reqs=len(running),
            num_waiting_reqs=len(scheduler.waiting),
            num_swapped_reqs=len(scheduler.swapped),
            kv_cache_usage=kv.usage,
            num_used_blocks=kv.num_used_blocks,
            num_total_blocks=kv.num_total_blocks,
            num_cached_free_blocks=kv.num_cached_free_blocks,
            num_cpu_blocks=kv.num_cpu_blocks,
            num_tokens_in_used_blocks=num_tokens,
            running_lora_adapters=adapter_names(running),
            waiting_lora_adapters=adapter_names(scheduler.waiting),
            prefix_cache_queries=queries - self._reported[0],
            prefix_cache_hits=hits - self._reported[1],
            num_preemptions=preemptions - self._reported[2],
            spec_decoding=scheduler.drafts.take_stats() if consume else None,
        )
        if consume:
            self._reported = (queries, hits, preemptions)
        return stats
