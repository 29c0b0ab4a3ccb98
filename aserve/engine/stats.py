"""Plain stats records the engine emits; metrics (Prometheus) and log lines consume them.

The engine calls every registered `StatLogger.record(scheduler, iteration)` once per step, from the
event loop (or the offline LLM's thread). Loggers must be cheap; they never block. The scheduler's
record (`SchedulerStats`, gauges plus per-step counter deltas) is defined once in `aserve.core.stats`.

`StatLineLogger` is the periodic throughput/state log line, shared by the server (which logs it from a
timer task, `aserve.server.metrics.LoggingStatLogger`) and the offline `LLM` (which logs it from
`record`, once an interval has passed, via `IntervalStatLineLogger`).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol

from aserve.core.stats import SchedulerStats, SpecDecodingStats  # noqa: F401 - re-exported for the server


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
    lora_name: str | None = None  # the adapter it ran with (None: the base model)
    max_num_generation_tokens: int = 0  # the most tokens one of its samples generated (n > 1: of n)
    trace: RequestTrace | None = None  # what its OpenTelemetry span needs (aserve/engine/tracing.py)


@dataclass
class RequestTrace:
    """A finished request's facts for its `llm_request` span: wall-clock (time.time()) arrival and
    finish, sampling parameters, the W3C trace headers it came with (`traceparent`, `tracestate`),
    and the seconds the model spent on the steps it was part of (0.0 unless detailed traces are on)."""

    request_id: str
    arrival_time: float
    finished_time: float
    time_to_first_token: float | None
    temperature: float
    top_p: float
    trace_headers: dict[str, str] | None = None
    model_forward_time: float = 0.0
    model_execute_time: float = 0.0


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


class StatLineLogger:
    """A StatLogger that sums per-step stats; `format_line()` gives one throughput/state line for the
    interval since its previous call (vLLM's line), or None when the engine was idle."""

    def __init__(self, interval: float = 5.0, clock: Callable[[], float] = time.monotonic,
                 log: Callable[[str], None] | None = None):
        self.interval = interval
        self._clock = clock
        self._log = log or logging.getLogger("aserve.engine.stats").info
        self._last_time = clock()
        self._prompt_tokens = 0
        self._generation_tokens = 0
        self._latest = SchedulerStats()
        self._prefix_queries = 0
        self._prefix_hits = 0
        self._spec = [0, 0, 0]  # drafts, draft tokens, accepted tokens (speculative decoding)
        self._changed = False

    def record(self, scheduler_stats: SchedulerStats, iteration_stats: IterationStats) -> None:
        self._prompt_tokens += iteration_stats.num_prompt_tokens
        self._generation_tokens += iteration_stats.num_generation_tokens
        self._prefix_queries += scheduler_stats.prefix_cache_queries
        self._prefix_hits += scheduler_stats.prefix_cache_hits
        spec = scheduler_stats.spec_decoding
        if spec is not None and spec.num_drafts:
            self._spec[0] += spec.num_drafts
            self._spec[1] += spec.num_draft_tokens
            self._spec[2] += spec.num_accepted_tokens
        self._latest = scheduler_stats
        self._changed = True

    def format_line(self) -> str | None:
        """The line for the interval since the last call (None if the engine was idle); resets the sums."""
        now = self._clock()
        elapsed = max(now - self._last_time, 1e-9)
        s = self._latest
        busy = self._changed and (
            self._prompt_tokens or self._generation_tokens or s.num_running_reqs or s.num_waiting_reqs
        )
        queries, hits = self._prefix_queries, self._prefix_hits
        line = None
        if busy:
            hit_rate = 100.0 * hits / queries if queries > 0 else 0.0
            line = (
                f"Avg prompt throughput: {self._prompt_tokens / elapsed:.1f} tokens/s, "
                f"Avg generation throughput: {self._generation_tokens / elapsed:.1f} tokens/s, "
                f"Running: {s.num_running_reqs} reqs, Waiting: {s.num_waiting_reqs} reqs, "
                f"Swapped: {s.num_swapped_reqs} reqs, KV cache usage: {100.0 * s.kv_cache_usage:.1f}%, "
                f"Prefix cache hit rate: {hit_rate:.1f}%"
            )
            drafts, draft_tokens, accepted = self._spec
            if drafts:  # vLLM's spec-decode figures
                line += (f", Spec decode: draft acceptance rate: {100.0 * accepted / draft_tokens:.1f}%, "
                         f"mean acceptance length: {1 + accepted / drafts:.2f}")
        self._last_time = now
        self._prompt_tokens = self._generation_tokens = 0
        self._prefix_queries = self._prefix_hits = 0
        self._spec = [0, 0, 0]
        self._changed = bool(s.num_running_reqs or s.num_waiting_reqs)
        return line

    def log_line(self) -> None:
        """Formats the interval's line and logs it (nothing when idle)."""
        line = self.format_line()
        if line is not None:
            self._log(line)


class IntervalStatLineLogger(StatLineLogger):
    """The line logged from `record` itself once `interval` seconds have passed since the last one:
    for a synchronous engine loop (the offline LLM) that has no timer task."""

    def record(self, scheduler_stats: SchedulerStats, iteration_stats: IterationStats) -> None:
        super().record(scheduler_stats, iteration_stats)
        if self._clock() - self._last_time >= self.interval:
            self.log_line()


class PreemptionWarner:
    """vLLM's preemption WARNING: logged for the first preemption and then once every `every`
    (cumulative count), so a cache that is too small shows in the log without flooding it."""

    def __init__(self, mode: str, every: int = 50, log: Callable[[str], None] | None = None):
        self.mode = mode  # "recompute" or "swap"
        self.every = every
        self.num_cumulative_preemptions = 0
        self._log = log or logging.getLogger("aserve.engine").warning

    def record(self, num_preemptions: int) -> None:
        """Adds a step's preemptions; logs once whenever the total passes 1, 1 + every, 1 + 2 * every..."""
        if num_preemptions <= 0:
            return
        before = self.num_cumulative_preemptions
        self.num_cumulative_preemptions += num_preemptions
        if (before - 1) // self.every != (self.num_cumulative_preemptions - 1) // self.every or before == 0:
            self._log(
                f"{num_preemptions} request(s) preempted by {self.mode.upper()} mode because there is not "
                "enough KV cache space. This can affect the end-to-end performance. Increase "
                "gpu_memory_utilization (or --cpu-kvcache-space / --kv-cache-memory-bytes) or "
                "tensor_parallel_size to provide more KV cache memory. "
                f"total_num_cumulative_preemption={self.num_cumulative_preemptions}"
            )
