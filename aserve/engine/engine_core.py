"""EngineCore: the one boundary between the engine front (intake, output processing) and the work
below it. It owns the scheduler and the executor; nothing else touches either.

    step() = schedule() -> execute_model() -> update()

With pipeline parallelism (`max_steps_in_flight` > 1, one step per stage) a step is split into
`submit(so)` and `collect()`, and the steps in flight are kept here: `next_step()` schedules while the
pipeline has room (the scheduler leaves requests in flight out), `collect()` waits for the oldest. The
offline `step()` fills the pipeline, then collects and applies the oldest step; the async engine does the
same on its loop (engine/pipelined_loop.py), with `submit` / `collect` on a worker thread.

The offline engine calls `step()`. The async engine calls the three pieces itself so that
`execute_model` runs on a worker thread while the event loop processes the previous step's outputs;
`execute_model` touches only the executor, never the scheduler, so that overlap is safe (and a streamed
multi-step call's steps may go through `update` on the loop while the call still runs). Scheduling
facts reach the front as `EngineCoreOutput.events` and `EngineCoreOutputs.scheduler_stats`.
"""

from __future__ import annotations

import importlib
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

from aserve.config import AserveConfig, ConfigError, KVCacheInfo
from aserve.core.batch import EngineCoreOutput, RunnerInfo, RunnerOutput, SchedulerOutput
from aserve.core.request import Request, RequestStatus
from aserve.core.scheduler import Scheduler
from aserve.core.stats import InflightRequest, SchedulerStats
from aserve.executor.base import Executor
from aserve.lora.request import LoRARequest


def load_scheduler_class(path: str | None) -> type[Scheduler]:
    """`--scheduler-cls`: the class at the dotted `path` (None: `Scheduler`). ConfigError naming the flag
    unless it imports and subclasses `Scheduler` (whose constructor and step protocol it keeps)."""
    if path is None:
        return Scheduler
    module_name, _, name = path.rpartition(".")
    try:
        cls = getattr(importlib.import_module(module_name), name)
    except (ImportError, AttributeError) as e:
        raise ConfigError(f"--scheduler-cls: cannot import {path!r}: {e}") from None
    if not (isinstance(cls, type) and issubclass(cls, Scheduler)):
        raise ConfigError(f"--scheduler-cls: {path!r} is not a subclass of aserve.core.scheduler.Scheduler")
    return cls


@dataclass
class EngineCoreOutputs:
    """One step's results: per-request outputs and the scheduler's stats after the step."""

    outputs: list[EngineCoreOutput]
    scheduler_stats: SchedulerStats
    model_times: StepModelTimes | None = None  # only with --collect-detailed-traces


@dataclass
class StepModelTimes:
    """One step's model timings (seconds) for the requests scheduled in it (sample ids): the forward
    pass as the runner measured it, and the executor call as the engine measured it."""

    req_ids: list[str]
    forward_time: float
    execute_time: float


class EngineCore:
    """Owns the scheduler and the (started) executor. Not thread-safe: one caller at a time, except
    that `execute_model` may run on another thread while the caller does anything but schedule/update."""

    def __init__(self, config: AserveConfig, executor: Executor, info: RunnerInfo):
        self.config = config
        self._executor = executor
        self.runner_info = info
        kv = KVCacheInfo(num_blocks=info.num_blocks, num_cpu_blocks=info.num_cpu_blocks, block_size=info.block_size)
        lora = config.lora
        scheduler_cls = load_scheduler_class(config.scheduler.scheduler_cls)
        self.scheduler = scheduler_cls(config.scheduler, config.cache, kv, lora.max_loras if lora.enable_lora else None,
                                       speculative=config.speculative)
        self._detailed_traces = config.observability.collect_detailed_traces
        self._last_execute_time = 0.0  # the latest execute_model call's seconds (detailed traces only)
        self.max_steps_in_flight = config.scheduler.max_steps_in_flight
        self._steps_in_flight: deque[tuple[SchedulerOutput, float]] = deque()  # (step, submitted at), oldest first

    # -- requests ---------------------------------------------------------------------------------
    def add_request(self, request: Request) -> None:
        self.scheduler.add_request(request)

    def abort_requests(self, req_ids: list[str]) -> None:
        """Finishes the requests (finish_reason "abort") and frees their KV blocks now."""
        self.scheduler.abort_requests(req_ids)

    def finish_stopped(self, req_ids: list[str]) -> None:
        """Samples whose text hit a stop string: finish them and free their blocks now."""
        self.scheduler.finish_requests(req_ids, RequestStatus.FINISHED_STOPPED)

    def has_unfinished_requests(self) -> bool:
        """Requests not finished, or pipelined steps not collected yet."""
        return self.scheduler.has_unfinished_requests() or bool(self._steps_in_flight)

    def num_unfinished_requests(self) -> int:
        """Requests waiting, running or swapped (each sample of an n > 1 request counts one)."""
        return len(self.scheduler.requests)

    def num_queued_prompt_tokens(self) -> int:
        """Prompt tokens of unfinished requests not yet computed (O(requests))."""
        return self.scheduler.num_queued_prompt_tokens()

    def reset_prefix_cache(self) -> bool:
        """Forgets every cached prefix block; False while any request holds blocks (nothing done)."""
        return self.scheduler.reset_prefix_cache()

    def current_stats(self) -> SchedulerStats:
        """A live view (gauges now) that does not consume the per-step counters."""
        return self.scheduler.make_stats(consume=False)

    def inflight_requests(self) -> list[InflightRequest]:
        """Every unfinished request in arrival order (O(requests)); plain data, no prompt text."""
        reqs = sorted(self.scheduler.requests.values(), key=lambda r: r.arrival_time)
        return [InflightRequest(r.request_id, r.status.name.lower(), r.num_prompt_tokens, r.num_output_tokens,
                                r.num_computed_tokens, r.arrival_time) for r in reqs]

    # -- the step ---------------------------------------------------------------------------------
    def schedule(self) -> SchedulerOutput:
        return self.scheduler.schedule()

    def execute_model(self, scheduler_output: SchedulerOutput,
                      on_progress: Callable[[RunnerOutput], None] | None = None) -> RunnerOutput:
        """Runs the step on the executor (blocking). Raises ExecutorDeadError when the runner is gone
        or failed in a way no single request owns: that is fatal for the engine. `on_progress`: a
        multi-step call's decode steps but the last, as they finish (Executor.execute); the caller
        passes each to `update` before the returned output."""
        if not self._detailed_traces:
            return self._executor.execute(scheduler_output, on_progress)
        start = time.perf_counter()
        output = self._executor.execute(scheduler_output, on_progress)
        self._last_execute_time = time.perf_counter() - start
        return output

    def update(self, scheduler_output: SchedulerOutput, runner_output: RunnerOutput,
               during_execute: bool = False) -> EngineCoreOutputs:
        """Applies the step's output. `during_execute`: a streamed multi-step call's decode step, applied
        on the caller's loop while `execute_model` still runs (the scheduler is the caller's alone then:
        `execute_model` never touches it); its execute time is counted with the call's last step."""
        outputs = self.scheduler.update(scheduler_output, runner_output)
        execute_time = 0.0 if during_execute else self._last_execute_time
        times = StepModelTimes(list(scheduler_output.scheduled_req_ids), runner_output.forward_time,
                               execute_time) if self._detailed_traces else None
        return EngineCoreOutputs(outputs, self.scheduler.make_stats(), times)

    # -- pipeline parallelism: several steps in flight ------------------------------------------------
    @property
    def num_steps_in_flight(self) -> int:
        return len(self._steps_in_flight)

    def next_step(self) -> SchedulerOutput | None:
        """The next step to submit, or None when the pipeline is full or the runner has nothing to do."""
        if len(self._steps_in_flight) >= self.max_steps_in_flight:
            return None
        scheduler_output = self.schedule()
        return scheduler_output if scheduler_output.needs_runner else None

    def submit(self, scheduler_output: SchedulerOutput) -> None:
        """Starts the step without waiting (the executor only queues it: no blocking)."""
        self._executor.submit(scheduler_output)
        self._steps_in_flight.append((scheduler_output, time.perf_counter()))

    def reply_fileno(self) -> int | None:
        """See Executor.reply_fileno: readable once `collect` would not wait (None: it may)."""
        return self._executor.reply_fileno()

    def collect(self) -> tuple[SchedulerOutput, RunnerOutput, float]:
        """The oldest step in flight, its output (blocking; ExecutorDeadError as `execute_model`) and the
        seconds since it was submitted; the caller applies it with `update`."""
        scheduler_output, submitted = self._steps_in_flight[0]
        output = self._executor.collect()
        self._steps_in_flight.popleft()
        seconds = time.perf_counter() - submitted
        if self._detailed_traces:
            self._last_execute_time = seconds
        return scheduler_output, output, seconds

    def step(self) -> EngineCoreOutputs:
        if self.max_steps_in_flight == 1:
            scheduler_output = self.schedule()
            return self.update(scheduler_output, self.execute_model(scheduler_output))
        while (scheduler_output := self.next_step()) is not None:
            self.submit(scheduler_output)
        if not self._steps_in_flight:
            return EngineCoreOutputs([], self.scheduler.make_stats())
        scheduler_output, output, _ = self.collect()
        return self.update(scheduler_output, output)

    # -- adapters (never while execute_model runs) ---------------------------------------------------
    def add_lora(self, lora_request: LoRARequest) -> None:
        """Load an adapter into the runner (blocking); LoRAAdapterError names what is wrong with it."""
        self._executor.add_lora(lora_request)

    def remove_lora(self, lora_int_id: int) -> bool:
        return self._executor.remove_lora(lora_int_id)

    # -- sleep mode (never while execute_model runs) -------------------------------------------------
    def sleep(self, level: int) -> None:
        """Release the runner's KV cache (level 1) and weights (level 2), blocking. RuntimeError (nothing
        done) while any request is unfinished. The prefix cache is forgotten: the blocks' contents are
        gone (the block pool itself stays)."""
        if self.scheduler.has_unfinished_requests():
            raise RuntimeError("cannot sleep while requests are unfinished")
        self._executor.sleep(level)
        self.scheduler.reset_prefix_cache()

    def wake_up(self, tags: tuple[str, ...] | None = None) -> None:
        """Bring back what `tags` names ("weights", "kv_cache"; None: both), blocking."""
        self._executor.wake_up(tags)

    def shutdown(self) -> None:
        self._executor.shutdown()
