"""Plain stats records the engine emits; metrics (Prometheus) and log lines consume them.

The engine calls every registered `StatLogger.record(scheduler, iteration)` once per step, from the
event loop (or the offline LLM's thread). Loggers must be cheap; they never block.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol


@dataclass
class SchedulerStats:
    """A snapshot of the scheduler after a step (gauges plus cumulative counters)."""

    num_running_reqs: int = 0
    num_waiting_reqs: int = 0
    num_swapped_reqs: int = 0
    kv_cache_usage: float = 0.0  # fraction of KV blocks in use, 0..1
    num_used_blocks: int = 0
    num_total_blocks: int = 0
    num_tokens_in_used_blocks: int = 0  # real tokens held by used blocks (utilization = tokens / (used * block_size))
    prefix_cache_queries: int = 0  # cumulative tokens looked up
    prefix_cache_hits: int = 0  # cumulative tokens found
    num_preemptions: int = 0  # cumulative


@dataclass
class FinishedRequestStats:
    """One request's life, reported once when it finishes (or is aborted)."""

    finish_reason: str  # "stop" | "length" | "abort" | "error"
    e2e_latency: float
    num_prompt_tokens: int
    num_generation_tokens: int
    max_tokens_param: int | None
    n: int
    queue_time: float
    prefill_time: float
    decode_time: float
    inference_time: float
    mean_time_per_output_token: float


@dataclass
class IterationStats:
    """What happened in one step."""

    num_prompt_tokens: int = 0  # prompt tokens computed this step
    num_generation_tokens: int = 0  # tokens sampled this step
    time_to_first_tokens: list[float] = field(default_factory=list)
    inter_token_latencies: list[float] = field(default_factory=list)
    num_preempted_reqs: int = 0
    finished_requests: list[FinishedRequestStats] = field(default_factory=list)
    step_time: float = 0.0


class StatLogger(Protocol):
    def record(self, scheduler_stats: SchedulerStats, iteration_stats: IterationStats) -> None: ...
