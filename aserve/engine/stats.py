"""Plain stats records the engine emits; metrics (Prometheus) and log lines consume them.

The engine calls every registered `StatLogger.record(scheduler, iteration)` once per step, from the
event loop (or the offline LLM's thread). Loggers must be cheap; they never block. The scheduler's
record (`SchedulerStats`, gauges plus per-step counter deltas) is defined once in `aserve.core.stats`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

from aserve.core.stats import SchedulerStats


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

    num_prompt_tokens: int = 0  # prompt tokens of requests whose first token came this step (cached included)
    num_generation_tokens: int = 0  # tokens sampled this step
    time_to_first_tokens: list[float] = field(default_factory=list)
    inter_token_latencies: list[float] = field(default_factory=list)
    finished_requests: list[FinishedRequestStats] = field(default_factory=list)
    step_time: float = 0.0


class StatLogger(Protocol):
    def record(self, scheduler_stats: SchedulerStats, iteration_stats: IterationStats) -> None: ...
