"""AsyncEngine: the scheduler task on the server's event loop.

Each step: schedule -> the executor runs the forward pass on a worker thread (off the loop) ->
meanwhile the previous step's outputs are processed (detokenize, stop strings, logprobs, streams)
-> update. Per-request streams are bounded: if a consumer lags, deltas merge into one pending
output instead of queueing without limit, and the engine never blocks on a slow client.

Errors: a failure one request owns ends that request's stream with an output whose `error` is set
(finish_reason "error"); everyone else keeps going. A failure of the executor (the worker died,
the device failed) is fatal: every open stream raises EngineDeadError, `is_healthy()` turns False
and `run()` raises.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import anyio

from aserve.config import EngineArgs
from aserve.core.batch import SLEEP_TAGS, RunnerOutput, SchedulerOutput
from aserve.core.stats import InflightRequest, SchedulerStats
from aserve.engine.builder import ExecutorFactory
from aserve.engine.engine_core import EngineCoreOutputs
from aserve.engine.errors import EngineBusyError, EngineSleepingError
from aserve.engine.llm_engine import LLMEngine
from aserve.engine.lora_registry import LoRARegistry
from aserve.engine.pipelined_loop import run_pipelined
from aserve.engine.stats import StatLogger
from aserve.executor.base import make_executor
from aserve.lora.request import LoRARequest
from aserve.outputs import CompletionOutput, RequestOutput
from aserve.sampling_params import RequestOutputKind, SamplingParams

# Where the model runs when the arguments do not say (see AsyncEngine.from_engine_args).
ASYNC_DEFAULT_EXECUTOR_BACKEND = "mp"
logger = logging.getLogger(__name__)


class EngineDeadError(RuntimeError):
    """The engine loop died; every pending and future request fails with this."""


def _merge_delta(into: RequestOutput, new: RequestOutput) -> None:
    by_index = {c.index: c for c in into.outputs}
    for c in new.outputs:
        old = by_index.get(c.index)
        if old is None:
            into.outputs.append(c)
            by_index[c.index] = c
            continue
        old.text += c.text
        old.token_ids = old.token_ids + c.token_ids
        if c.logprobs is not None:
            old.logprobs = (old.logprobs or []) + c.logprobs
        old.cumulative_logprob = c.cumulative_logprob
        old.finish_reason, old.stop_reason = c.finish_reason, c.stop_reason
    into.finished = new.finished
    into.metrics = new.metrics
    into.error = new.error
    if new.prompt_logprobs is not None:
        into.prompt_logprobs = new.prompt_logprobs


class RequestStream:
    """Async iterator over one request's outputs. Holds at most one pending (merged) output."""

    def __init__(self, request_id: str, kind: RequestOutputKind):
        self.request_id = request_id
        self.kind = kind
        self.prompt_token_ids: list[int] = []
        self._pending: RequestOutput | None = None
        self._error: BaseException | None = None
        self._event = anyio.Event()
        self._done = False

    def put(self, out: RequestOutput) -> None:
        if self._pending is None or self.kind != RequestOutputKind.DELTA:
            self._pending = out
        else:
            _merge_delta(self._pending, out)
        self._event.set()

    def fail(self, exc: BaseException) -> None:
        self._error = exc
        self._event.set()

    @property
    def finished(self) -> bool:
        return self._done

    def __aiter__(self) -> RequestStream:
        return self

    async def __anext__(self) -> RequestOutput:
        if self._done:
            raise StopAsyncIteration
        while self._pending is None and self._error is None:
            await self._event.wait()
            self._event = anyio.Event()
        if self._pending is not None:
            out, self._pending = self._pending, None
            if out.finished:
                self._done = True
            return out
        self._done = True
        raise self._error


class AsyncEngine:
    def __init__(self, engine: LLMEngine):
        self.engine = engine
        self.model_config = engine.model_config
        self.config = engine.config
        self.tokenizer = engine.tokenizer
        self.streams: dict[str, RequestStream] = {}
        self._wakeup = anyio.Event()
        self._stopping = False
        self.dead_error: BaseException | None = None
        self.overlap = not engine.config.runner.disable_async_output_proc
        # Multi-step decode: deliver each decode step's tokens while the call runs (else at its end).
        self.stream_decode_steps = engine.config.scheduler.multi_step_stream_outputs
        # The executor runs one call at a time: a step, or an adapter load between steps (FIFO).
        self._executor_lock = anyio.Lock(fast_acquire=True)  # taken twice a step: no yield when free
        self._submits_held = 0  # callers waiting for the steps in flight to drain (`_between_steps`)
        self._asleep: set[str] = set()  # sleep mode: the parts (SLEEP_TAGS) not woken up yet
        self._sleeps_pending = 0  # /sleep calls waiting for a wake-up in progress: requests stay out
        self._sleep_lock = anyio.Lock()  # one sleep or wake-up at a time, its state change included

    @classmethod
    def from_engine_args(cls, args: EngineArgs, stat_loggers: list[StatLogger] | None = None,
                         executor_factory: ExecutorFactory = make_executor) -> AsyncEngine:
        """Without an explicit `distributed_executor_backend` the async engine runs the model in a
        worker process (`mp`): on a thread, the event loop's own work (HTTP, detokenizing, SSE)
        competes with the forward pass for the GIL and the cores, which doubled the per-token
        latency at c=1 on 2 CPU cores (44 vs 23 ms, README). The offline `LLM` keeps `uni`."""
        if (args.distributed_executor_backend is None and args.tensor_parallel_size == 1
                and args.pipeline_parallel_size == 1):  # more ranks: mp or ray
            args = dataclasses.replace(args, distributed_executor_backend=ASYNC_DEFAULT_EXECUTOR_BACKEND)
        return cls(LLMEngine.from_engine_args(args, stat_loggers, executor_factory))

    # -- health -----------------------------------------------------------------------------------
    def is_healthy(self) -> bool:
        return self.dead_error is None

    async def check_health(self) -> None:
        if self.dead_error is not None:
            raise EngineDeadError(str(self.dead_error))

    def add_stat_logger(self, stat_logger: StatLogger) -> None:
        self.engine.stat_loggers.append(stat_logger)

    def get_scheduler_stats(self) -> SchedulerStats:
        """A live view of the scheduler (gauges now); does not consume the per-step counters."""
        return self.engine.core.current_stats()

    def inflight_requests(self) -> list[InflightRequest]:
        """The unfinished requests now (ids, state, token counts, arrival time; no prompt text)."""
        return self.engine.core.inflight_requests()

    def check_guided_decoding(self, params: SamplingParams) -> None:
        """Blocking (call it off the event loop): SamplingParamsError naming the field unless the
        request's grammar spec compiles; verdicts are cached by spec, so intake's own check is a hit."""
        self.engine.inputs.check_guided_decoding(params)

    async def reset_prefix_cache(self) -> bool:
        """vLLM's POST /reset_prefix_cache: False (nothing done) while requests hold KV blocks."""
        return self.engine.core.reset_prefix_cache()

    @property
    def generation_defaults(self) -> dict:
        return self.engine.generation_defaults

    # -- requests ---------------------------------------------------------------------------------
    def add_request(self, request_id: str, prompt: str | None, prompt_token_ids: list[int] | None,
                    params: SamplingParams, priority: int = 0, client_id: str | None = None,
                    lora_request: LoRARequest | None = None,
                    trace_headers: dict[str, str] | None = None) -> RequestStream:
        """Validates (raises SamplingParamsError naming the field) and queues a request; `client_id`
        (a hash of the API key, never the key) shares the batch fairly between clients;
        `lora_request` must be registered (`add_lora`); `trace_headers` (W3C `traceparent`,
        `tracestate`) parent its OpenTelemetry span."""
        if self.dead_error is not None:
            raise EngineDeadError(f"engine is dead: {self.dead_error}")
        if self._stopping:
            raise EngineDeadError("engine is shutting down")
        if self._asleep or self._sleeps_pending:
            raise EngineSleepingError("the model is sleeping (sleep mode): POST /wake_up to serve requests again")
        stream = RequestStream(request_id, params.output_kind)
        stream.prompt_token_ids = self.engine.add_request(
            request_id, prompt, params, prompt_token_ids, priority, client_id=client_id, lora_request=lora_request,
            trace_headers=trace_headers)
        self.streams[request_id] = stream
        self._wakeup.set()
        return stream

    # -- adapters ---------------------------------------------------------------------------------
    @property
    def loras(self) -> LoRARegistry:
        """The registered adapters (read-only use: register through `add_lora`)."""
        return self.engine.loras

    async def add_lora(self, lora_request: LoRARequest) -> bool:
        """Load and register an adapter between steps (requests keep running). True if it was new;
        LoRAAdapterError names what is wrong with it."""
        if self.dead_error is not None:
            raise EngineDeadError(f"engine is dead: {self.dead_error}")
        if self.engine.loras.is_registered(lora_request):
            return False
        async with self._between_steps():
            return await anyio.to_thread.run_sync(self.engine.add_lora, lora_request)

    async def remove_lora(self, name: str) -> bool:
        """Forget the adapter named `name` (requests already running with it finish with it)."""
        lora_request = self.engine.loras.get(name)
        if lora_request is None:
            return False
        async with self._between_steps():
            return await anyio.to_thread.run_sync(self.engine.remove_lora, lora_request.lora_int_id)

    @asynccontextmanager
    async def _between_steps(self) -> AsyncIterator[None]:
        """The executor to the caller alone, with no step running: under async scheduling (or pipeline
        parallelism) steps stay in flight between the loop's turns, so no new one is submitted until the
        loop has collected those in flight; then the executor lock, as between two steps."""
        self._submits_held += 1
        try:
            while self.engine.core.num_steps_in_flight:
                if self.dead_error is not None:
                    raise EngineDeadError(f"engine is dead: {self.dead_error}")
                await anyio.sleep(0.001)
            async with self._executor_lock:
                yield
        finally:
            self._submits_held -= 1

    # -- sleep mode -------------------------------------------------------------------------------
    @property
    def sleep_mode_enabled(self) -> bool:
        return self.config.runner.enable_sleep_mode

    def is_sleeping(self) -> bool:
        """True from `sleep` until every part has been woken up."""
        return bool(self._asleep or self._sleeps_pending)

    async def sleep(self, level: int = 1) -> None:
        """Release the KV cache (level 1) and the weights too (level 2) between steps; new requests
        fail with EngineSleepingError until `wake_up`. Only when idle: EngineBusyError (nothing done)
        while any request is unfinished. ValueError for another level or without sleep mode."""
        if not self.sleep_mode_enabled:
            raise ValueError("sleep mode is off: start the engine with enable_sleep_mode (--enable-sleep-mode)")
        if level not in (1, 2):
            raise ValueError(f"sleep level must be 1 or 2, got {level}")
        if self.dead_error is not None:
            raise EngineDeadError(f"engine is dead: {self.dead_error}")
        if self.engine.has_unfinished_requests() or self.streams:
            raise EngineBusyError(f"cannot sleep while {max(len(self.streams), 1)} requests are running")
        self._sleeps_pending += 1  # before any await: no request can enter from here on
        try:
            async with self._sleep_lock:
                self._asleep = set(SLEEP_TAGS)
                await self._call_executor(self.engine.core.sleep, level)
        finally:
            self._sleeps_pending -= 1

    async def wake_up(self, tags: list[str] | None = None) -> None:
        """Bring back the parts `tags` names ("weights", "kv_cache"; None: both); requests are served
        again once every part is back. ValueError for an unknown tag; a no-op while awake."""
        unknown = [t for t in tags or () if t not in SLEEP_TAGS]
        if unknown:
            raise ValueError(f"unknown wake-up tags {unknown}: use {list(SLEEP_TAGS)}")
        parts = set(tags) if tags else set(SLEEP_TAGS)
        async with self._sleep_lock:  # after a sleep queued before it, never in the middle of one
            if not self._asleep & parts:
                return
            await self._call_executor(self.engine.core.wake_up, tuple(sorted(parts)) if tags else None)
            self._asleep -= parts

    async def _call_executor(self, fn, *args) -> None:
        """Between steps; a failure (ExecutorDeadError) kills the engine, as in a step."""
        async with self._executor_lock:
            try:
                await anyio.to_thread.run_sync(fn, *args)
            except Exception as exc:  # noqa: BLE001 - recorded (the engine is dead), re-raised
                self.dead_error = exc
                raise

    def queued_load(self, count_tokens: bool = True) -> tuple[int, int]:
        """(requests waiting, running or swapped: each sample of an n > 1 request counts one; their
        prompt tokens not yet computed, or 0 without `count_tokens`). For admission control: call it
        and add_request with no await in between."""
        core = self.engine.core
        return core.num_unfinished_requests(), core.num_queued_prompt_tokens() if count_tokens else 0

    async def abort(self, request_id: str) -> None:
        """Frees the request's KV blocks now (the scheduler drops it before the next step)."""
        stream = self.streams.pop(request_id, None)
        out = self.engine.abort_request(request_id)
        if stream is not None and out is not None:
            stream.put(out)

    def shutdown(self) -> None:
        self._stopping = True
        self._wakeup.set()

    # -- the loop ---------------------------------------------------------------------------------
    def _deliver(self, outputs: EngineCoreOutputs, step_time: float) -> None:
        processed = self.engine.process(outputs, step_time)
        for out in processed.request_outputs:
            stream = self.streams.get(out.request_id)
            if stream is None:
                continue
            stream.put(out)
            if out.finished:
                del self.streams[out.request_id]

    async def _execute(self, so: SchedulerOutput, result: list) -> None:
        """Runs the step on a worker thread; an error is stored, not raised, so it is not wrapped in a group.
        A streamed multi-step call's decode steps are applied and delivered on the loop as they finish."""
        on_progress = None
        if so.decode_steps and self.stream_decode_steps:
            started = [time.perf_counter()]

            def deliver_step(step: RunnerOutput) -> None:  # on the event loop, while the call runs
                now = time.perf_counter()
                self._deliver(self.engine.core.update(so, step, during_execute=True), now - started[0])
                started[0] = now

            def on_progress(step: RunnerOutput) -> None:  # on the worker thread
                anyio.from_thread.run_sync(deliver_step, step)
        try:
            async with self._executor_lock:
                result.append(await anyio.to_thread.run_sync(self.engine.core.execute_model, so, on_progress))
        except Exception as exc:
            result.append(exc)

    async def run(self, *, task_status=anyio.TASK_STATUS_IGNORED) -> None:
        """The engine loop. Returns after shutdown(); raises (and fails every stream) if the engine dies."""
        task_status.started()
        pending: EngineCoreOutputs | None = None
        core = self.engine.core
        pending_time = 0.0
        try:
            if core.max_steps_in_flight > 1:  # pipeline parallelism: several steps in flight
                await run_pipelined(self)
                return
            while not self._stopping or self.engine.has_unfinished_requests():
                if not self.engine.has_unfinished_requests():
                    if pending is not None:
                        self._deliver(pending, pending_time)
                        pending = None
                        continue
                    if self._stopping:
                        break
                    await self._wakeup.wait()
                    self._wakeup = anyio.Event()
                    continue
                start = time.perf_counter()
                so = core.schedule()
                result: list = []
                if self.overlap and pending is not None:
                    async with anyio.create_task_group() as tg:
                        tg.start_soon(self._execute, so, result)
                        self._deliver(pending, pending_time)  # overlaps the forward pass
                    pending = None
                else:
                    if pending is not None:
                        self._deliver(pending, pending_time)
                        pending = None
                    await self._execute(so, result)
                if isinstance(result[0], Exception):
                    raise result[0]
                outs = core.update(so, result[0])
                pending, pending_time = outs, time.perf_counter() - start
                if not self.overlap:
                    self._deliver(pending, pending_time)
                    pending = None
                await anyio.sleep(0)  # let request handlers run between steps
            if pending is not None:
                self._deliver(pending, pending_time)
        except BaseException as exc:
            if not isinstance(exc, anyio.get_cancelled_exc_class()):
                logger.exception("Engine loop died")
                self.dead_error = exc
            err = EngineDeadError(f"engine loop stopped: {exc!r}")
            for stream in self.streams.values():
                stream.fail(err)
            self.streams.clear()
            raise
        finally:
            self.engine.shutdown()
