"""LLMEngine: intake -> EngineCore -> output processing, as plain synchronous steps.

The offline `LLM` calls `step()`; the async engine drives the same pieces (`schedule`, `execute`,
`update`, `process`) so that output processing of one step overlaps the next step's forward pass.
"""

from __future__ import annotations

import itertools
import time

from aserve.config import EngineArgs
from aserve.core.batch import EngineCoreOutput, RunnerOutput, SchedulerOutput
from aserve.engine.engine_core import EngineParts, build_engine
from aserve.engine.input_processor import InputProcessor
from aserve.engine.output_processor import OutputProcessor, ProcessedOutputs
from aserve.engine.stats import IterationStats, StatLogger
from aserve.outputs import RequestOutput
from aserve.sampling_params import RequestOutputKind, SamplingParams, SamplingParamsError


class LLMEngine:
    def __init__(self, parts: EngineParts, stat_loggers: list[StatLogger] | None = None):
        self.parts = parts
        self.config = parts.config
        self.model_config = parts.config.model
        self.tokenizer = parts.tokenizer
        self.core = parts.core
        self.inputs = InputProcessor(parts.config, parts.tokenizer, parts.eos_token_ids)
        self.outputs = OutputProcessor(parts.tokenizer)
        self.stat_loggers: list[StatLogger] = list(stat_loggers or [])
        self._ids = itertools.count()

    @classmethod
    def from_engine_args(cls, args: EngineArgs, stat_loggers: list[StatLogger] | None = None,
                         **runner_kwargs) -> LLMEngine:
        return cls(build_engine(args, **runner_kwargs), stat_loggers)

    @property
    def generation_defaults(self) -> dict:
        return self.parts.generation_defaults

    def default_sampling_params(self) -> SamplingParams:
        return SamplingParams(**self.generation_defaults)

    def next_request_id(self) -> str:
        return str(next(self._ids))

    # -- intake -----------------------------------------------------------------------------------
    def add_request(self, request_id: str, prompt: str | None, params: SamplingParams,
                    prompt_token_ids: list[int] | None = None, priority: int = 0,
                    arrival_time: float | None = None) -> list[int]:
        """Validates and queues a request. Returns its prompt token ids. Raises SamplingParamsError."""
        if self.outputs.has_request(request_id):
            raise SamplingParamsError("request_id", f"request {request_id!r} is already running")
        if priority != 0 and self.config.scheduler.policy != "priority":
            raise SamplingParamsError("priority", "needs --scheduling-policy priority")
        token_ids = self.inputs.process_prompt(prompt, prompt_token_ids, params)
        arrival = time.time() if arrival_time is None else arrival_time
        user_logprobs = params.logprobs is not None
        sample_ids = self.outputs.add_request(request_id, prompt, token_ids, params, user_logprobs, arrival)
        for request in self.inputs.make_requests(sample_ids, token_ids, params, arrival, priority):
            self.core.add_request(request)
        return token_ids

    def abort_request(self, request_id: str) -> RequestOutput | None:
        """Frees the request's KV blocks now; returns its final output (finish_reason 'abort')."""
        sample_ids = self.outputs.sample_ids(request_id)
        if sample_ids:
            self.core.abort_requests(sample_ids)
        return self.outputs.abort_request(request_id)

    def has_unfinished_requests(self) -> bool:
        return self.core.has_unfinished_requests()

    # -- the step, in pieces ----------------------------------------------------------------------
    def schedule(self) -> SchedulerOutput:
        so = self.core.schedule()
        if so.new_requests:
            now = time.time()
            for new in so.new_requests:
                owner = self.outputs.sample_owner.get(new.req_id)
                if owner is not None and owner[0].metrics.first_scheduled_time is None:
                    owner[0].metrics.first_scheduled_time = now
        return so

    def execute(self, so: SchedulerOutput) -> RunnerOutput:
        return self.core.executor.execute(so)

    def update(self, so: SchedulerOutput, ro: RunnerOutput) -> list[EngineCoreOutput]:
        return self.core.update(so, ro)

    def process(self, outputs: list[EngineCoreOutput], step_time: float = 0.0) -> ProcessedOutputs:
        processed = self.outputs.process_outputs(outputs)
        if processed.reqs_to_finish:
            self.core.finish_stopped(processed.reqs_to_finish)
        processed.iteration_stats.step_time = step_time
        self.record_stats(processed.iteration_stats)
        return processed

    def record_stats(self, iteration: IterationStats) -> None:
        if not self.stat_loggers:
            return
        sched = self.core.scheduler_stats()
        for logger in self.stat_loggers:
            logger.record(sched, iteration)

    def step(self) -> list[RequestOutput]:
        start = time.perf_counter()
        so = self.schedule()
        ro = self.execute(so)
        outs = self.update(so, ro)
        return self.process(outs, time.perf_counter() - start).request_outputs

    def shutdown(self) -> None:
        self.core.shutdown()


__all__ = ["LLMEngine", "RequestOutputKind"]
