"""OpenTelemetry request spans (aserve/engine/tracing.py) from a real tiny server: one `llm_request`
span per request with vLLM's attribute names and the response's values, a W3C `traceparent` making it
a child of the caller's trace, spans exported over OTLP/HTTP to a receiver this test runs, and the
start-up refusals (detailed traces without an endpoint, the packages missing)."""

from __future__ import annotations

import sys
import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import httpx
import pytest

pytest.importorskip("opentelemetry.sdk.trace", reason="the otel extra (pip install 'aserve[otel]')")

from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
    ExportTraceServiceRequest,
    ExportTraceServiceResponse,
)
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import SpanKind

from aserve.config import ConfigError, EngineArgs
from aserve.config.observability import exporter_endpoint, otlp_protocol
from aserve.engine.tracing import RequestTracer
from tests.server.real_tiny_server import build_tiny_chat_model, serving
from tests.server.server_harness import quiet_args

pytestmark = pytest.mark.timeout(300)

TRACE_ID = "4bf92f3577b34da6a3ce929d0e0e4736"
PARENT_SPAN_ID = "00f067aa0ba902b7"
TRACEPARENT = f"00-{TRACE_ID}-{PARENT_SPAN_ID}-01"
_BASE_ATTRIBUTES = {
    "gen_ai.request.id", "gen_ai.request.max_tokens", "gen_ai.request.temperature", "gen_ai.request.top_p",
    "gen_ai.request.n", "gen_ai.usage.prompt_tokens", "gen_ai.usage.completion_tokens",
    "gen_ai.latency.time_in_queue", "gen_ai.latency.time_to_first_token", "gen_ai.latency.e2e",
    "gen_ai.response.model",
}
_DETAILED = {"gen_ai.latency.time_in_model_forward", "gen_ai.latency.time_in_model_execute"}


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory) -> str:
    return build_tiny_chat_model(tmp_path_factory.mktemp("tiny-traced"))


def _chat(url: str, headers: dict[str, str] | None = None, **body) -> dict:
    payload = {"model": body.pop("model"), "messages": [{"role": "user", "content": "Hello, how are you?"}],
               "max_tokens": 6, "temperature": 0.5, "top_p": 0.9, "seed": 1, **body}
    r = httpx.post(f"{url}/v1/chat/completions", json=payload, headers=headers or {}, timeout=60)
    assert r.status_code == 200, r.text
    return r.json()


def test_one_span_per_request_with_vllm_attributes_and_the_callers_trace(tiny_model):
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    with serving(tiny_model, quiet_args()) as (engine, address):
        engine.add_stat_logger(RequestTracer(provider, tiny_model))
        before = time.time_ns()
        reply = _chat(address.url, {"traceparent": TRACEPARENT}, model=tiny_model)
        after = time.time_ns()
        r = httpx.post(f"{address.url}/v1/completions", timeout=60, json={
            "model": tiny_model, "prompt": "The quick brown fox", "max_tokens": 4, "n": 2, "temperature": 1.0})
        assert r.status_code == 200, r.text
        completion = r.json()
    spans = exporter.get_finished_spans()
    assert [s.name for s in spans] == ["llm_request", "llm_request"]
    chat_span, completion_span = spans

    assert chat_span.kind == SpanKind.SERVER
    attrs = dict(chat_span.attributes)
    assert _BASE_ATTRIBUTES <= set(attrs) and not _DETAILED & set(attrs)
    assert attrs["gen_ai.request.id"] == reply["id"]
    assert attrs["gen_ai.response.model"] == reply["model"] == tiny_model
    assert attrs["gen_ai.usage.prompt_tokens"] == reply["usage"]["prompt_tokens"]
    assert attrs["gen_ai.usage.completion_tokens"] == reply["usage"]["completion_tokens"] > 0
    assert (attrs["gen_ai.request.max_tokens"], attrs["gen_ai.request.n"]) == (6, 1)
    assert attrs["gen_ai.request.temperature"] == pytest.approx(0.5)
    assert attrs["gen_ai.request.top_p"] == pytest.approx(0.9)
    # the span runs from arrival to finish, and its latencies fit inside it
    assert before <= chat_span.start_time <= chat_span.end_time <= after
    duration = (chat_span.end_time - chat_span.start_time) / 1e9
    assert attrs["gen_ai.latency.e2e"] == pytest.approx(duration, abs=1e-3)
    assert 0 <= attrs["gen_ai.latency.time_in_queue"] <= attrs["gen_ai.latency.time_to_first_token"] \
        <= attrs["gen_ai.latency.e2e"]
    # the traceparent header: the span is a child of the caller's span, in the caller's trace
    assert format(chat_span.context.trace_id, "032x") == TRACE_ID
    assert chat_span.parent is not None and format(chat_span.parent.span_id, "016x") == PARENT_SPAN_ID
    assert chat_span.parent.is_remote

    # no traceparent: a trace of its own; n=2 samples are one request, their tokens summed
    c_attrs = dict(completion_span.attributes)
    assert completion_span.parent is None and format(completion_span.context.trace_id, "032x") != TRACE_ID
    assert c_attrs["gen_ai.request.id"].startswith(completion["id"])
    assert c_attrs["gen_ai.request.n"] == 2
    assert c_attrs["gen_ai.usage.prompt_tokens"] == completion["usage"]["prompt_tokens"]
    assert c_attrs["gen_ai.usage.completion_tokens"] == completion["usage"]["completion_tokens"]


class _Receiver:
    """An OTLP/HTTP trace receiver on 127.0.0.1: POST /v1/traces bodies decoded as ExportTraceServiceRequest."""

    def __init__(self) -> None:
        self.requests: list[ExportTraceServiceRequest] = []
        self.content_types: list[str] = []
        receiver = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                body = self.rfile.read(int(self.headers["Content-Length"]))
                if self.path != "/v1/traces":
                    self.send_error(404)
                    return
                message = ExportTraceServiceRequest()
                message.ParseFromString(body)
                receiver.requests.append(message)
                receiver.content_types.append(self.headers["Content-Type"])
                reply = ExportTraceServiceResponse().SerializeToString()
                self.send_response(200)
                self.send_header("Content-Type", "application/x-protobuf")
                self.send_header("Content-Length", str(len(reply)))
                self.end_headers()
                self.wfile.write(reply)

            def log_message(self, *args) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.port = self.server.server_address[1]

    def spans(self) -> list:
        return [span for request in self.requests for resource in request.resource_spans
                for scope in resource.scope_spans for span in scope.spans]


@pytest.fixture
def receiver() -> Iterator[_Receiver]:
    r = _Receiver()
    thread = threading.Thread(target=r.server.serve_forever, daemon=True)
    thread.start()
    yield r
    r.server.shutdown()
    thread.join()


def test_spans_reach_an_otlp_http_receiver_with_detailed_traces(tiny_model, receiver):
    endpoint = f"http://127.0.0.1:{receiver.port}/v1/traces"
    with serving(tiny_model, quiet_args(), otlp_traces_endpoint=endpoint, collect_detailed_traces="all") \
            as (_, address):
        reply = _chat(address.url, {"traceparent": TRACEPARENT}, model=tiny_model)
    # the engine's shutdown flushed the batched span
    assert receiver.content_types and set(receiver.content_types) == {"application/x-protobuf"}
    (span,) = receiver.spans()
    assert span.name == "llm_request" and span.kind == span.SPAN_KIND_SERVER
    assert span.trace_id.hex() == TRACE_ID and span.parent_span_id.hex() == PARENT_SPAN_ID
    attrs = {kv.key: kv.value for kv in span.attributes}
    assert _BASE_ATTRIBUTES | _DETAILED <= set(attrs)
    assert attrs["gen_ai.request.id"].string_value == reply["id"]
    assert attrs["gen_ai.usage.completion_tokens"].int_value == reply["usage"]["completion_tokens"]
    assert attrs["gen_ai.usage.prompt_tokens"].int_value == reply["usage"]["prompt_tokens"]
    forward = attrs["gen_ai.latency.time_in_model_forward"].double_value
    execute = attrs["gen_ai.latency.time_in_model_execute"].double_value
    e2e = attrs["gen_ai.latency.e2e"].double_value
    assert 0 < forward <= execute <= e2e  # the forward pass is part of the executor call, inside the request
    resource = {kv.key: kv.value.string_value for kv in receiver.requests[0].resource_spans[0].resource.attributes}
    assert resource["service.name"] == "aserve"


def test_detailed_traces_need_an_endpoint():
    with pytest.raises(ConfigError, match="--collect-detailed-traces: needs --otlp-traces-endpoint"):
        EngineArgs(collect_detailed_traces="model").validate()
    with pytest.raises(ConfigError, match="--collect-detailed-traces: must be one or more of model, worker, all"):
        EngineArgs(otlp_traces_endpoint="localhost:4317", collect_detailed_traces="model,gpu").validate()
    EngineArgs(otlp_traces_endpoint="localhost:4317", collect_detailed_traces="model,worker").validate()


@pytest.mark.parametrize("endpoint, module", [
    ("http://127.0.0.1:4318", "opentelemetry.exporter.otlp.proto.http.trace_exporter"),
    ("grpc://127.0.0.1:4317", "opentelemetry.exporter.otlp.proto.grpc.trace_exporter"),
    ("127.0.0.1:4317", "opentelemetry.sdk.trace"),
])
def test_missing_packages_are_a_start_up_error_naming_the_flag(tiny_model, monkeypatch, endpoint, module):
    from aserve.engine.builder import build_engine

    monkeypatch.setitem(sys.modules, module, None)  # `import module` now raises ImportError

    def no_model_work(*args, **kwargs):
        raise AssertionError("the model was resolved before the packages were checked")

    monkeypatch.setattr("aserve.model_source.resolve_model", no_model_work)
    with pytest.raises(ConfigError, match=r"--otlp-traces-endpoint: .*not installed.*pip install 'aserve\[otel\]'"):
        build_engine(EngineArgs(model=tiny_model, otlp_traces_endpoint=endpoint))


def test_protocol_follows_the_scheme_unless_the_environment_says():
    assert otlp_protocol("http://collector:4318", env={}) == "http/protobuf"
    assert otlp_protocol("https://collector", env={}) == "http/protobuf"
    assert otlp_protocol("grpc://collector:4317", env={}) == "grpc"
    assert otlp_protocol("collector:4317", env={}) == "grpc"
    assert otlp_protocol("http://collector:4317", env={"OTEL_EXPORTER_OTLP_TRACES_PROTOCOL": "grpc"}) == "grpc"
    with pytest.raises(ConfigError, match="--otlp-traces-endpoint: OTEL_EXPORTER_OTLP_TRACES_PROTOCOL='http/json'"):
        otlp_protocol("collector:4317", env={"OTEL_EXPORTER_OTLP_TRACES_PROTOCOL": "http/json"})
    assert exporter_endpoint("http://collector:4318", "http/protobuf") == ("http://collector:4318/v1/traces", True)
    assert exporter_endpoint("https://c/otlp/v1/traces", "http/protobuf") == ("https://c/otlp/v1/traces", False)
    assert exporter_endpoint("grpc://collector:4317", "grpc") == ("collector:4317", True)
    assert exporter_endpoint("collector:4317", "grpc") == ("collector:4317", True)
    assert exporter_endpoint("https://collector:4317", "grpc") == ("collector:4317", False)


def test_exporter_per_protocol():
    from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter as GrpcExporter
    from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter as HttpExporter

    from aserve.config.observability import ObservabilityConfig
    from aserve.engine.tracing import make_span_exporter

    grpc = make_span_exporter(ObservabilityConfig("grpc://127.0.0.1:4317"))
    http = make_span_exporter(ObservabilityConfig("http://127.0.0.1:4318"))
    assert isinstance(grpc, GrpcExporter) and isinstance(http, HttpExporter)
    grpc.shutdown()
    http.shutdown()
