"""OpenTelemetry request spans (vLLM's tracing): one `llm_request` span (SpanKind.SERVER) per finished
request, with vLLM's `gen_ai.*` attribute names, from the request's arrival to its finish.

`RequestTracer` is a `StatLogger`: it reads each finished request's `FinishedRequestStats.trace`
(aserve/engine/stats.py), so no span work happens on the hot path before a request finishes. A request
that came with W3C trace headers (`traceparent`, `tracestate`; the server passes them to
`AsyncEngine.add_request`) gets a span in the caller's trace; others start a trace of their own.

`make_request_tracer(config, model_name)` exports over OTLP to `--otlp-traces-endpoint` (the protocol
rule is aserve/config/observability.py's); a test passes its own `tracer_provider` (for example with
the SDK's InMemorySpanExporter) and nothing global is set. The OpenTelemetry packages are optional
(`pip install 'aserve[otel]'`) and imported only here, only when tracing is asked for;
`check_otel_available` turns their absence into a ConfigError naming the flag.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any

from aserve.config import ConfigError
from aserve.config.observability import ObservabilityConfig, exporter_endpoint, otlp_protocol
from aserve.core.stats import SchedulerStats
from aserve.engine.stats import FinishedRequestStats, IterationStats

logger = logging.getLogger("aserve.engine.tracing")

TRACE_HEADERS = ("traceparent", "tracestate")
SPAN_NAME = "llm_request"
_INSTALL_HINT = "pip install 'aserve[otel]' (opentelemetry-sdk and its OTLP exporters)"


class SpanAttributes:
    """vLLM's attribute names (vllm/tracing.py), the gen_ai semantic conventions' where they exist."""

    GEN_AI_USAGE_COMPLETION_TOKENS = "gen_ai.usage.completion_tokens"
    GEN_AI_USAGE_PROMPT_TOKENS = "gen_ai.usage.prompt_tokens"
    GEN_AI_REQUEST_MAX_TOKENS = "gen_ai.request.max_tokens"
    GEN_AI_REQUEST_TOP_P = "gen_ai.request.top_p"
    GEN_AI_REQUEST_TEMPERATURE = "gen_ai.request.temperature"
    GEN_AI_RESPONSE_MODEL = "gen_ai.response.model"
    GEN_AI_REQUEST_ID = "gen_ai.request.id"
    GEN_AI_REQUEST_N = "gen_ai.request.n"
    GEN_AI_LATENCY_TIME_IN_QUEUE = "gen_ai.latency.time_in_queue"
    GEN_AI_LATENCY_TIME_TO_FIRST_TOKEN = "gen_ai.latency.time_to_first_token"
    GEN_AI_LATENCY_E2E = "gen_ai.latency.e2e"
    GEN_AI_LATENCY_TIME_IN_MODEL_FORWARD = "gen_ai.latency.time_in_model_forward"
    GEN_AI_LATENCY_TIME_IN_MODEL_EXECUTE = "gen_ai.latency.time_in_model_execute"
    GEN_AI_LATENCY_TIME_IN_MODEL_PREFILL = "gen_ai.latency.time_in_model_prefill"
    GEN_AI_LATENCY_TIME_IN_MODEL_DECODE = "gen_ai.latency.time_in_model_decode"
    GEN_AI_LATENCY_TIME_IN_MODEL_INFERENCE = "gen_ai.latency.time_in_model_inference"


def extract_trace_headers(headers: Mapping[str, str]) -> dict[str, str] | None:
    """The W3C trace headers among `headers` (keys compared lower-case), or None when there are none.
    Plain strings: needs no OpenTelemetry package."""
    found = {name: headers[name] for name in TRACE_HEADERS if name in headers}
    return found or None


def _exporter_module(protocol: str) -> str:
    grpc = protocol == "grpc"
    return f"opentelemetry.exporter.otlp.proto.{'grpc' if grpc else 'http'}.trace_exporter"


def check_otel_available(config: ObservabilityConfig) -> None:
    """ConfigError naming --otlp-traces-endpoint unless the SDK and the exporter its protocol needs
    import (nothing to check without an endpoint). Call it before any model work."""
    if config.otlp_traces_endpoint is None:
        return
    import importlib

    protocol = otlp_protocol(config.otlp_traces_endpoint)
    for module in ("opentelemetry.sdk.trace", "opentelemetry.trace.propagation.tracecontext",
                   _exporter_module(protocol)):
        try:
            importlib.import_module(module)
        except ImportError as exc:
            raise ConfigError(f"--otlp-traces-endpoint: tracing over OTLP ({protocol}) needs the OpenTelemetry "
                              f"packages, which are not installed ({exc}); {_INSTALL_HINT}") from None


def make_span_exporter(config: ObservabilityConfig) -> Any:
    """The OTLP span exporter for `config.otlp_traces_endpoint` (which must be set)."""
    import importlib

    endpoint = config.otlp_traces_endpoint
    assert endpoint is not None
    check_otel_available(config)
    protocol = otlp_protocol(endpoint)
    target, insecure = exporter_endpoint(endpoint, protocol)
    exporter_cls = importlib.import_module(_exporter_module(protocol)).OTLPSpanExporter
    if protocol == "grpc":
        return exporter_cls(endpoint=target, insecure=insecure)
    return exporter_cls(endpoint=target)


def make_request_tracer(config: ObservabilityConfig, model_name: str,
                        tracer_provider: Any = None) -> RequestTracer | None:
    """A `RequestTracer` exporting through `tracer_provider` (an SDK TracerProvider the caller owns),
    else through a new provider batching spans to `config.otlp_traces_endpoint`; None when neither is
    given. Raises ConfigError naming the flag when the packages are missing."""
    if tracer_provider is None and config.otlp_traces_endpoint is None:
        return None
    owned = tracer_provider is None
    if owned:
        from opentelemetry.sdk.resources import Resource
        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.sdk.trace.export import BatchSpanProcessor

        tracer_provider = TracerProvider(resource=Resource.create({"service.name": "aserve"}))
        tracer_provider.add_span_processor(BatchSpanProcessor(make_span_exporter(config)))
        logger.info("Tracing: one %s span per request to %s (OTLP %s)", SPAN_NAME, config.otlp_traces_endpoint,
                    otlp_protocol(config.otlp_traces_endpoint or ""))
    return RequestTracer(tracer_provider, model_name, config, owns_provider=owned)


class RequestTracer:
    """A StatLogger that ends one `llm_request` span per finished request (see the module docstring).
    `shutdown()` flushes the spans still batched when it owns the provider."""

    def __init__(self, tracer_provider: Any, model_name: str, config: ObservabilityConfig | None = None,
                 owns_provider: bool = False):
        from opentelemetry.trace import SpanKind, Status, StatusCode
        from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

        self._provider = tracer_provider
        self._tracer = tracer_provider.get_tracer("aserve")
        self._propagator = TraceContextTextMapPropagator()
        self._kind = SpanKind.SERVER
        self._error_status = Status(StatusCode.ERROR)
        self.model_name = model_name
        self.config = config or ObservabilityConfig()
        self._owns_provider = owns_provider

    def record(self, scheduler_stats: SchedulerStats, iteration_stats: IterationStats) -> None:
        for finished in iteration_stats.finished_requests:
            if finished.trace is not None:
                self.emit(finished)

    def emit(self, stats: FinishedRequestStats) -> None:
        """Starts and ends the request's span at its arrival and finish times."""
        trace = stats.trace
        assert trace is not None
        context = self._propagator.extract(trace.trace_headers) if trace.trace_headers else None
        span = self._tracer.start_span(SPAN_NAME, context=context, kind=self._kind,
                                       start_time=int(trace.arrival_time * 1e9))
        a = SpanAttributes
        attributes: dict[str, Any] = {
            a.GEN_AI_RESPONSE_MODEL: stats.lora_name or self.model_name,
            a.GEN_AI_REQUEST_ID: trace.request_id,
            a.GEN_AI_REQUEST_TEMPERATURE: trace.temperature,
            a.GEN_AI_REQUEST_TOP_P: trace.top_p,
            a.GEN_AI_REQUEST_N: stats.n,
            a.GEN_AI_USAGE_PROMPT_TOKENS: stats.num_prompt_tokens,
            a.GEN_AI_USAGE_COMPLETION_TOKENS: stats.num_generation_tokens,
            a.GEN_AI_LATENCY_TIME_IN_QUEUE: stats.queue_time,
            a.GEN_AI_LATENCY_E2E: stats.e2e_latency,
            a.GEN_AI_LATENCY_TIME_IN_MODEL_PREFILL: stats.prefill_time,
            a.GEN_AI_LATENCY_TIME_IN_MODEL_DECODE: stats.decode_time,
            a.GEN_AI_LATENCY_TIME_IN_MODEL_INFERENCE: stats.inference_time,
        }
        if stats.max_tokens_param is not None:
            attributes[a.GEN_AI_REQUEST_MAX_TOKENS] = stats.max_tokens_param
        if trace.time_to_first_token is not None:
            attributes[a.GEN_AI_LATENCY_TIME_TO_FIRST_TOKEN] = trace.time_to_first_token
        if self.config.collect_model_forward_time:
            attributes[a.GEN_AI_LATENCY_TIME_IN_MODEL_FORWARD] = trace.model_forward_time
        if self.config.collect_model_execute_time:
            attributes[a.GEN_AI_LATENCY_TIME_IN_MODEL_EXECUTE] = trace.model_execute_time
        span.set_attributes(attributes)
        if stats.finish_reason == "error":
            span.set_status(self._error_status)
        span.end(end_time=int(trace.finished_time * 1e9))

    def shutdown(self) -> None:
        """Flushes and stops the exporter (only a provider it made itself)."""
        if self._owns_provider:
            self._provider.shutdown()
