"""The scheduler's stats record, defined once (pure Python: core, engine and server all import it).

`Scheduler.make_stats()` fills it after a step: gauges hold the state now; counters hold what
happened since the previous `make_stats()` (per-step deltas), so a consumer adds them up (a
Prometheus counter `.inc(delta)`) and never has to turn totals back into deltas.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class SchedulerStats:
    # Gauges (now).
    num_running_reqs: int = 0
    num_waiting_reqs: int = 0
    num_swapped_reqs: int = 0
    kv_cache_usage: float = 0.0  # fraction of usable KV blocks in use, 0..1
    num_used_blocks: int = 0
    num_total_blocks: int = 0
    num_tokens_in_used_blocks: int = 0  # computed tokens held by the running requests' blocks
    running_lora_adapters: list[str] = field(default_factory=list)  # adapter names of running requests
    waiting_lora_adapters: list[str] = field(default_factory=list)  # ... of waiting requests (not running)
    # Counters (deltas since the previous make_stats()).
    prefix_cache_queries: int = 0  # prompt tokens looked up in the prefix cache
    prefix_cache_hits: int = 0  # of those, tokens found
    num_preemptions: int = 0  # running requests preempted
