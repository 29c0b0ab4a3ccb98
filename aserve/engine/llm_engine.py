"""LLMEngine: intake -> EngineCore -> output processing, as plain synchronous steps.

The offline `LLM` calls `step()`. The async engine drives the same pieces (`core.schedule`,
`core.execute_model`, `core.update`, `process`) so that output processing of one step overlaps the
next step's forward pass.
"""

from __future__ import annotations

import itertools
import dataclasses
import time

from aserve.config import EngineArgs
from aserve.engine.builder import EngineParts, ExecutorFactory, build_engine
from aserve.engine.engine_core import EngineCoreOutputs
from aserve.engine.input_processor import InputProcessor
from aserve.engine.output_processor import OutputProcessor, ProcessedOutputs
from aserve.engine.pooling_inputs import PoolingInputProcessor, TextPair
from aserve.engine.pooling_outputs import PoolingOutputProcessor
from aserve.engine.stats import IterationStats, PreemptionWarner, StatLogger
from aserve.engine.lora_registry import LoRARegistry
from aserve.engine.tracing import make_request_tracer
from aserve.executor.base import make_executor
from aserve.lora.errors import LoRAAdapterError
from aserve.lora.request import LoRARequest
from aserve.outputs import RequestOutput
from aserve.pooling_params import PoolingParams
from aserve.sampling_params import SamplingParams, SamplingParamsError


class LLMEngine:
    def __init__(self, parts: EngineParts, stat_loggers: list[StatLogger] | None = None):
        self.config = parts.config
        self.model_config = parts.config.model
        self.tokenizer = parts.tokenizer
        self.generation_defaults = parts.generation_defaults
        self.core = parts.core
        self.inputs = InputProcessor(parts.config, parts.tokenizer, parts.eos_token_ids)
        self.pooling_inputs = PoolingInputProcessor(parts.config, parts.tokenizer) if parts.config.is_pooling else None
        self.outputs = PoolingOutputProcessor() if parts.config.is_pooling else OutputProcessor(parts.tokenizer)
        self.stat_loggers: list[StatLogger] = list(stat_loggers or [])
        self.tracer = make_request_tracer(parts.config.observability, parts.config.model.served_model_name)
        if self.tracer is not None:  # --otlp-traces-endpoint: one span per finished request
            self.stat_loggers.append(self.tracer)
        self.preemption_warner = PreemptionWarner(parts.config.scheduler.preemption_mode or "recompute")
        self.loras = LoRARegistry(parts.config.lora.enable_lora, parts.config.lora.max_loras)
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
    def add_request(self, request_id: str, prompt: str | TextPair | None, params: SamplingParams | PoolingParams,
                    prompt_token_ids: list[int] | None = None, priority: int = 0,
                    arrival_time: float | None = None, client_id: str | None = None,
                    lora_request: LoRARequest | None = None,
                    trace_headers: dict[str, str] | None = None) -> list[int]:
        """Validates and queues a request. Returns its prompt token ids. Raises SamplingParamsError.
        `trace_headers` (W3C `traceparent`, `tracestate`) make its `llm_request` span a child of the caller's.
        `client_id` names who sent it (the server passes a hash of the API key) for fair sharing.
        `lora_request` must be registered (`add_lora`). `PoolingParams` make a pooling request (a
        pooling engine takes only those; `prompt` may then be a text pair for a cross-encoder)."""
        self._check_task(params)
        if lora_request is not None and not self._lora_registered(lora_request):
            raise SamplingParamsError("lora_request", f"adapter {lora_request.lora_name!r} is not loaded "
                                      "(add_lora first)")
        if self.outputs.has_request(request_id):
            raise SamplingParamsError("request_id", f"request {request_id!r} is already running")
        if priority != 0 and self.config.scheduler.policy != "priority":
            raise SamplingParamsError("priority", "needs --scheduling-policy priority")
        arrival = time.time() if arrival_time is None else arrival_time
        if isinstance(params, PoolingParams):
            token_ids, params = self.pooling_inputs.process(prompt, prompt_token_ids, params)
            self.outputs.add_request(request_id, prompt if isinstance(prompt, str) else None, token_ids, arrival)
            self.core.add_request(self.pooling_inputs.make_request(request_id, token_ids, params, arrival, priority,
                                                                   client_id))
            return token_ids
        token_ids = self.inputs.process_prompt(prompt, prompt_token_ids, params)
        user_logprobs = params.logprobs is not None
        sample_ids = self.outputs.add_request(request_id, prompt, token_ids, params, user_logprobs, arrival,
                                              lora_request, trace_headers)
        for request in self.inputs.make_requests(sample_ids, token_ids, params, arrival, priority, client_id,
                                                 lora_request):
            self.core.add_request(request)
        return token_ids

    def _check_task(self, params: SamplingParams | PoolingParams) -> None:
        pooling = self.config.pooling
        if pooling is not None and not isinstance(params, PoolingParams):
            raise SamplingParamsError("task", f"this model serves --task {pooling.task}, not text generation; "
                                      "send pooling requests (embed, classify, score)")
        if pooling is None and isinstance(params, PoolingParams):
            raise SamplingParamsError("task", "this model generates text (--task generate); serve a pooling model "
                                      "(--task embed, classify or score) for embeddings and scores")

    def _lora_registered(self, lora_request: LoRARequest) -> bool:
        try:
            return self.loras.is_registered(lora_request)
        except LoRAAdapterError as e:
            raise SamplingParamsError("lora_request", str(e)) from None

    # -- adapters (vLLM's LLMEngine.add_lora / remove_lora / list_loras) ------------------------
    def add_lora(self, lora_request: LoRARequest) -> bool:
        """Load and register an adapter (blocking; never while a step runs). True if it was new;
        LoRAAdapterError names what is wrong with it."""
        return self.loras.register(lora_request, self.core.add_lora)

    def remove_lora(self, lora_int_id: int) -> bool:
        """Forget an adapter (requests already running with it finish with it)."""
        lora_request = self.loras.get_by_id(lora_int_id)
        if lora_request is None:
            return False
        self.loras.unregister(lora_request.lora_name)
        self.core.remove_lora(lora_int_id)
        return True

    def list_loras(self) -> set[int]:
        return {r.lora_int_id for r in self.loras.list()}

    def abort_request(self, request_id: str) -> RequestOutput | None:
        """Frees the request's KV blocks now; returns its final output (finish_reason 'abort')."""
        sample_ids = self.outputs.sample_ids(request_id)
        if sample_ids:
            self.core.abort_requests(sample_ids)
        if not isinstance(self.outputs, OutputProcessor):
            return self.outputs.abort_request(request_id)
        stats = IterationStats()
        out = self.outputs.abort_request(request_id, stats)
        if stats.finished_requests:  # the abort reaches the metrics and traces like any finish
            # the gauges now; the per-step counters stay for the next step's record
            scheduler_stats = dataclasses.replace(self.core.current_stats(), prefix_cache_queries=0,
                                                  prefix_cache_hits=0, num_preemptions=0, spec_decoding=None)
            for logger in self.stat_loggers:
                logger.record(scheduler_stats, stats)
        return out

    def has_unfinished_requests(self) -> bool:
        return self.core.has_unfinished_requests()

    # -- output processing ------------------------------------------------------------------------
    def process(self, core_outputs: EngineCoreOutputs, step_time: float = 0.0) -> ProcessedOutputs:
        """The one loop over a step's outputs; samples that hit a stop string or failed are finished in
        the scheduler now (their blocks freed before the next step)."""
        times = core_outputs.model_times
        if times is not None and isinstance(self.outputs, OutputProcessor):
            self.outputs.add_model_times(times.req_ids, times.forward_time, times.execute_time)
        processed = self.outputs.process_outputs(core_outputs.outputs)
        if processed.reqs_to_finish:
            self.core.finish_stopped(processed.reqs_to_finish)
        if processed.reqs_to_abort:
            self.core.abort_requests(processed.reqs_to_abort)
        processed.iteration_stats.step_time = step_time
        self.preemption_warner.record(core_outputs.scheduler_stats.num_preemptions)
        for logger in self.stat_loggers:
            logger.record(core_outputs.scheduler_stats, processed.iteration_stats)
        return processed

    def step(self) -> list[RequestOutput]:
        start = time.perf_counter()
        core_outputs = self.core.step()
        return self.process(core_outputs, time.perf_counter() - start).request_outputs

    def shutdown(self) -> None:
        self.core.shutdown()
        if self.tracer is not None:
            self.tracer.shutdown()  # flushes the spans still batched
