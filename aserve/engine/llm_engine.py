"""LLMEngine: intake -> EngineCore -> output processing, as plain synchronous steps.

The offline `LLM` calls `step()`. The async engine drives the same pieces (`core.schedule`,
`core.execute_model`, `core.update`, `process`) so that output processing of one step overlaps the
next step's forward pass.
"""

from __future__ import annotations

import itertools
import time

from aserve.config import EngineArgs
from aserve.engine.builder import EngineParts, ExecutorFactory, build_engine
from aserve.engine.engine_core import EngineCoreOutputs
from aserve.engine.input_processor import InputProcessor
from aserve.engine.output_processor import OutputProcessor, ProcessedOutputs
from aserve.engine.stats import StatLogger
from aserve.executor.base import make_executor
from aserve.outputs import RequestOutput
from aserve.sampling_params import SamplingParams, SamplingParamsError


class LLMEngine:
    def __init__(self, parts: EngineParts, stat_loggers: list[StatLogger] | None = None):
        self.config = parts.config
        self.model_config = parts.config.model
        self.tokenizer = parts.tokenizer
        self.generation_defaults = parts.generation_defaults
        self.core = parts.core
        self.inputs = InputProcessor(parts.config, parts.tokenizer, parts.eos_token_ids)
        self.outputs = OutputProcessor(parts.tokenizer)
        self.stat_loggers: list[StatLogger] = list(stat_loggers or [])
        self._ids = itertools.count()

    @classmethod
    def from_engine_args(cls, args: EngineArgs, stat_loggers: list[StatLogger] | None = None,
                         executor_factory: ExecutorFactory = make_executor) -> LLMEngine:
        return cls(build_engine(args, executor_factory), stat_loggers)

    def default_sampling_params(self) -> SamplingParams:
        return SamplingParams(**self.generation_defaults)

    def next_request_id(self) -> str:
        return str(next(self._ids))

    # -- intake -----------------------------------------------------------------------------------
    def add_request(self, request_id: str, prompt: str | None, params: SamplingParams,
                    prompt_token_ids: list[int] | None = None, priority: int = 0,
                    arrival_time: float | None = None, client_id: str | None = None) -> list[int]:
        """Validates and queues a request. Returns its prompt token ids. Raises SamplingParamsError.
        `client_id` names who sent it (the server passes a hash of the API key) for fair sharing."""
        if self.outputs.has_request(request_id):
            raise SamplingParamsError("request_id", f"request {request_id!r} is already running")
        if priority != 0 and self.config.scheduler.policy != "priority":
            raise SamplingParamsError("priority", "needs --scheduling-policy priority")
        token_ids = self.inputs.process_prompt(prompt, prompt_token_ids, params)
        arrival = time.time() if arrival_time is None else arrival_time
        user_logprobs = params.logprobs is not None
        sample_ids = self.outputs.add_request(request_id, prompt, token_ids, params, user_logprobs, arrival)
        for request in self.inputs.make_requests(sample_ids, token_ids, params, arrival, priority, client_id):
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

    # -- output processing ------------------------------------------------------------------------
    def process(self, core_outputs: EngineCoreOutputs, step_time: float = 0.0) -> ProcessedOutputs:
        """The one loop over a step's outputs; samples that hit a stop string or failed are finished in
        the scheduler now (their blocks freed before the next step)."""
        processed = self.outputs.process_outputs(core_outputs.outputs)
        if processed.reqs_to_finish:
            self.core.finish_stopped(processed.reqs_to_finish)
        if processed.reqs_to_abort:
            self.core.abort_requests(processed.reqs_to_abort)
        processed.iteration_stats.step_time = step_time
        for logger in self.stat_loggers:
            logger.record(core_outputs.scheduler_stats, processed.iteration_stats)
        return processed

    def step(self) -> list[RequestOutput]:
        start = time.perf_counter()
        core_outputs = self.core.step()
        return self.process(core_outputs, time.perf_counter() - start).request_outputs

    def shutdown(self) -> None:
        self.core.shutdown()
