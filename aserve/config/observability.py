"""OpenTelemetry tracing settings (vLLM's ObservabilityConfig): `--otlp-traces-endpoint` and
`--collect-detailed-traces`.

The wire protocol follows from the endpoint (`otlp_protocol`): `OTEL_EXPORTER_OTLP_TRACES_PROTOCOL`
(`grpc` or `http/protobuf`) wins when set, as in vLLM; otherwise an `http://` / `https://` URL means
OTLP over HTTP (protobuf; a URL without a path gets `/v1/traces`) and `grpc://host:port` or a bare
`host:port` means OTLP over gRPC (plaintext unless the URL is `https://`).
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass
from urllib.parse import urlsplit

from aserve.config.errors import require

DETAILED_TRACE_MODULES = ("model", "worker", "all")
OTLP_PROTOCOLS = ("grpc", "http/protobuf")
PROTOCOL_ENV = "OTEL_EXPORTER_OTLP_TRACES_PROTOCOL"


@dataclass(frozen=True)
class ObservabilityConfig:
    """`otlp_traces_endpoint` None: no tracing. `collect_model_forward_time` ("model" or "all") adds
    `gen_ai.latency.time_in_model_forward`, `collect_model_execute_time` ("worker" or "all") adds
    `gen_ai.latency.time_in_model_execute` to each request's span."""

    otlp_traces_endpoint: str | None = None
    collect_model_forward_time: bool = False
    collect_model_execute_time: bool = False

    @property
    def collect_detailed_traces(self) -> bool:
        return self.collect_model_forward_time or self.collect_model_execute_time


def parse_detailed_traces(value: str | None) -> tuple[str, ...]:
    """`--collect-detailed-traces` ("model", "worker", "all", comma-separated) as a tuple of those
    names; ConfigError naming the flag on any other name."""
    if value is None:
        return ()
    names = tuple(part.strip() for part in value.split(",") if part.strip())
    for name in names:
        require(name in DETAILED_TRACE_MODULES, "collect_detailed_traces",
                f"must be one or more of {', '.join(DETAILED_TRACE_MODULES)} (comma-separated), got {value!r}")
    return names


def otlp_protocol(endpoint: str, env: Mapping[str, str] | None = None) -> str:
    """"grpc" or "http/protobuf" for `endpoint` (see the module docstring); ConfigError naming the
    flag when the environment asks for another protocol."""
    env = os.environ if env is None else env
    forced = env.get(PROTOCOL_ENV)
    if forced:
        require(forced in OTLP_PROTOCOLS, "otlp_traces_endpoint",
                f"{PROTOCOL_ENV}={forced!r} is not supported (use one of {', '.join(OTLP_PROTOCOLS)})")
        return forced
    return "http/protobuf" if urlsplit(endpoint).scheme in ("http", "https") else "grpc"


def exporter_endpoint(endpoint: str, protocol: str) -> tuple[str, bool]:
    """(the endpoint to hand the OTLP exporter, insecure): for HTTP a URL with a path (`/v1/traces`
    when it had none); for gRPC `host:port` and whether the channel is plaintext (not https://)."""
    parts = urlsplit(endpoint if "://" in endpoint else f"//{endpoint}")
    if protocol == "http/protobuf":
        path = parts.path if parts.path not in ("", "/") else "/v1/traces"
        scheme = parts.scheme or "http"
        return f"{scheme}://{parts.netloc}{path}", scheme != "https"
    return parts.netloc or endpoint, parts.scheme != "https"


def validate_observability_args(otlp_traces_endpoint: str | None, collect_detailed_traces: str | None) -> None:
    """ConfigError naming the flag: an empty or unparsable endpoint, an unknown detailed-traces
    module, detailed traces without an endpoint (as vLLM), an unsupported protocol in the env."""
    modules = parse_detailed_traces(collect_detailed_traces)
    if otlp_traces_endpoint is not None:
        require(otlp_traces_endpoint.strip() != "", "otlp_traces_endpoint", "must not be empty")
        protocol = otlp_protocol(otlp_traces_endpoint)
        target, _ = exporter_endpoint(otlp_traces_endpoint, protocol)
        require(bool(target), "otlp_traces_endpoint", f"no host in {otlp_traces_endpoint!r}")
    require(not modules or otlp_traces_endpoint is not None, "collect_detailed_traces",
            "needs --otlp-traces-endpoint (detailed traces are sent with the request spans)")


def resolve_observability(otlp_traces_endpoint: str | None, collect_detailed_traces: str | None
                          ) -> ObservabilityConfig:
    """The frozen config for already-validated arguments."""
    modules = parse_detailed_traces(collect_detailed_traces)
    return ObservabilityConfig(
        otlp_traces_endpoint=otlp_traces_endpoint,
        collect_model_forward_time="model" in modules or "all" in modules,
        collect_model_execute_time="worker" in modules or "all" in modules,
    )
