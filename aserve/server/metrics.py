"""Prometheus metrics and the periodic stats log line, both fed by the engine's StatLogger callback.

Each app owns its `CollectorRegistry` (no global prometheus state), so several apps can live in
one process (tests). Every name carries the prefix given (`--metrics-prefix`: `vllm`, the default, so
vLLM dashboards and alerts work unchanged, or `aserve`), a `model_name` label and, on the engine's
series, vLLM's `engine` label (the data-parallel replica; "0" with one). Besides vLLM's names,
seed 004's vendor names: `request_total` (requests received), `request_process_success_total`
(processed successfully), `request_process_fail_total` (failed), `inference_compute_infer_duration`
(a histogram of each request's inference seconds, first scheduled to finished), `lora_count` and
`lora_time_e2e_requests` (`lora_metrics.py`).
"""

from __future__ import annotations

import copy
import logging
import time
from collections.abc import Callable
from typing import Any

import anyio
from anyio.abc import TaskStatus
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST

from aserve.config.schema import CacheConfig
from aserve.engine.stats import IterationStats, SchedulerStats, StatLineLogger
from aserve.server.lora_metrics import LoRAMetrics
from aserve.server.spec_decode_metrics import SpecDecodeMetrics

logger = logging.getLogger("aserve.server.stats")

CONTENT_TYPE = CONTENT_TYPE_LATEST
METRICS_PREFIXES = ("vllm", "aserve")

_TTFT_BUCKETS = [
    0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75,
    1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0,
]  # fmt: skip
_ITL_BUCKETS = [
    0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5,
    0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0,
]  # fmt: skip
_LATENCY_BUCKETS = [
    0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0,
    30.0, 40.0, 50.0, 60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0,
]  # fmt: skip
_N_BUCKETS = [1, 2, 5, 10, 20]
_CACHE_INFO_LABELS = ["model_name", "block_size", "num_gpu_blocks", "num_cpu_blocks", "cache_dtype",
                      "enable_prefix_caching", "gpu_memory_utilization", "swap_space", "num_gpu_blocks_override"]


def token_buckets(max_value: int) -> list[float]:
    """1-2-5 buckets (1, 2, 5, 10, 20, 50, ...) up to `max_value`."""
    buckets: list[float] = []
    exponent = 0
    while True:
        for mantissa in (1, 2, 5):
            value = mantissa * 10**exponent
            if value > max_value:
                return buckets
            buckets.append(float(value))
        exponent += 1


class PrometheusStatLogger:
    """A StatLogger that keeps aserve's Prometheus metrics in its own registry."""

    def __init__(self, model_name: str, max_model_len: int, registry: CollectorRegistry | None = None,
                 max_loras: int | None = None, num_speculative_tokens: int | None = None,
                 prefix: str = "vllm"):
        """`max_loras`: LoRA is enabled with this many adapter slots (adds `lora_metrics.py`'s series).
        `num_speculative_tokens`: speculative decoding is on (adds `spec_decode_metrics.py`'s series).
        `prefix`: one of METRICS_PREFIXES, before the colon of every name; ValueError otherwise."""
        if prefix not in METRICS_PREFIXES:
            raise ValueError(f"metrics prefix must be one of {METRICS_PREFIXES}, got {prefix!r}")
        self.registry = registry or CollectorRegistry()
        self.model_name = model_name
        self.prefix = prefix
        self.engine = "0"  # the `engine` label: which data-parallel replica (see for_engine)
        self._children: dict[tuple, Any] = {}  # _label's children, per view
        labels = ["model_name", "engine"]
        reg = self.registry
        tok_buckets = token_buckets(max(max_model_len, 1))

        def counter(name: str, doc: str, extra: tuple[str, ...] = ()) -> Counter:
            return Counter(f"{prefix}:{name}", doc, labels + list(extra), registry=reg)

        def gauge(name: str, doc: str) -> Gauge:
            return Gauge(f"{prefix}:{name}", doc, labels, registry=reg, multiprocess_mode="sum")

        def histogram(name: str, doc: str, buckets: list[float]) -> Histogram:
            return Histogram(f"{prefix}:{name}", doc, labels, buckets=buckets, registry=reg)

        # gauges (scheduler state)
        self.num_requests_running = gauge("num_requests_running", "Requests in the running batch.")
        self.num_requests_waiting = gauge("num_requests_waiting", "Requests waiting to be scheduled.")
        self.num_requests_swapped = gauge("num_requests_swapped", "Requests swapped out to CPU.")
        self.gpu_cache_usage = gauge("gpu_cache_usage_perc", "KV-cache usage, 0..1 (1 = full); vLLM's name.")
        self.kv_cache_usage = gauge("kv_cache_usage_perc", "KV-cache usage, 0..1 (1 = full).")
        # counters
        self.prefix_cache_queries = counter(
            "prefix_cache_queries", "Prompt tokens looked up in the prefix cache."
        )
        self.prefix_cache_hits = counter("prefix_cache_hits", "Prompt tokens found in the prefix cache.")
        self.num_preemptions = counter("num_preemptions", "Cumulative number of preemptions.")
        self.prompt_tokens = counter("prompt_tokens", "Prompt tokens computed (prefill).")
        self.generation_tokens = counter("generation_tokens", "Tokens generated.")
        self.request_success = counter(
            "request_success", "Requests that finished (stop or length).", ("finished_reason",)
        )
        self.request_failure = counter(
            "request_failure",
            "Requests that ended without finishing: aborted, engine errors, or rejected by the server.",
            ("reason",),
        )
        # seed 004's vendor counters: received = processed successfully + failed + in flight
        self.request_received = counter("request", "Requests received (generation and pooling endpoints).")
        self.request_process_success = counter(
            "request_process_success", "Requests processed successfully (finished by stop or length)."
        )
        self.request_process_fail = counter(
            "request_process_fail", "Requests that failed: rejected, aborted or engine errors."
        )
        # per-request histograms
        self.request_prompt_tokens = histogram(
            "request_prompt_tokens", "Prompt tokens per request.", tok_buckets
        )
        self.request_generation_tokens = histogram(
            "request_generation_tokens", "Generated tokens per request.", tok_buckets
        )
        self.request_params_n = histogram("request_params_n", "The n parameter of requests.", _N_BUCKETS)
        self.request_params_max_tokens = histogram(
            "request_params_max_tokens", "The max_tokens parameter.", tok_buckets
        )
        self.time_to_first_token = histogram(
            "time_to_first_token_seconds", "Time to first token.", _TTFT_BUCKETS
        )
        self.inter_token_latency = histogram(
            "inter_token_latency_seconds", "Time between tokens.", _ITL_BUCKETS
        )
        self.time_per_output_token = histogram(
            "time_per_output_token_seconds",
            "Time between tokens (vLLM's older name for inter-token latency).",
            _ITL_BUCKETS,
        )
        self.request_time_per_output_token = histogram(
            "request_time_per_output_token_seconds",
            "Mean time per output token of each request.",
            _ITL_BUCKETS,
        )
        self.e2e_latency = histogram(
            "e2e_request_latency_seconds", "End-to-end request latency.", _LATENCY_BUCKETS
        )
        self.queue_time = histogram(
            "request_queue_time_seconds", "Time waiting before first scheduled.", _LATENCY_BUCKETS
        )
        self.inference_time = histogram(
            "request_inference_time_seconds", "Time scheduled (prefill + decode).", _LATENCY_BUCKETS
        )
        self.prefill_time = histogram("request_prefill_time_seconds", "Time in prefill.", _LATENCY_BUCKETS)
        self.decode_time = histogram("request_decode_time_seconds", "Time in decode.", _LATENCY_BUCKETS)
        self.inference_compute = histogram(
            "inference_compute_infer_duration",
            "Inference compute seconds per request (first scheduled to finished; seed 004).",
            _LATENCY_BUCKETS,
        )
        self.request_max_num_generation_tokens = histogram(
            "request_max_num_generation_tokens",
            "The most tokens any one sample of a request generated.",
            tok_buckets,
        )
        self.iteration_tokens = histogram(
            "iteration_tokens_total", "Tokens (prompt + generated) per step.", token_buckets(1 << 16)
        )
        self.cache_config_info = Gauge(
            f"{prefix}:cache_config_info", "The KV-cache configuration (labels); value 1.", _CACHE_INFO_LABELS,
            registry=reg, multiprocess_mode="mostrecent",
        )

        self._expose()
        self.lora = LoRAMetrics(model_name, max_loras, reg, prefix) if max_loras is not None else None
        self.spec_decode = (SpecDecodeMetrics(model_name, num_speculative_tokens, reg, prefix)
                            if num_speculative_tokens is not None else None)

    def _expose(self) -> None:
        """Every series of this view at zero, so a scrape before the first request sees them."""
        for metric in vars(self).values():
            if isinstance(metric, (Counter, Gauge, Histogram)) and metric._labelnames == ("model_name", "engine"):
                self._label(metric)
        for reason in ("stop", "length"):
            self._label(self.request_success, finished_reason=reason)

    def for_engine(self, index: int) -> PrometheusStatLogger:
        """The view data-parallel replica `index` records through: the same series (and registry) under
        `engine="index"`, as vLLM labels them; LoRA and speculative-decoding series sum over replicas."""
        view = copy.copy(self)
        view.engine = str(index)
        view._children = {}
        view._expose()
        return view

    def record_cache_config(self, cache: CacheConfig, num_gpu_blocks: int, num_cpu_blocks: int) -> None:
        """Sets `cache_config_info` (vLLM's info gauge: value 1, the configuration in its labels)."""
        self.cache_config_info.clear()
        self.cache_config_info.labels(
            model_name=self.model_name,
            block_size=str(cache.block_size),
            num_gpu_blocks=str(num_gpu_blocks),
            num_cpu_blocks=str(num_cpu_blocks),
            cache_dtype=cache.kv_cache_dtype,
            enable_prefix_caching=str(cache.enable_prefix_caching),
            gpu_memory_utilization=str(cache.gpu_memory_utilization),
            swap_space=str(cache.swap_space_gb),
            num_gpu_blocks_override=str(cache.num_gpu_blocks_override),
        ).set(1)

    def record_received(self) -> None:
        """A request arrived on an endpoint that runs the model (counted before any check)."""
        self._label(self.request_received).inc()

    def _label(self, metric: Any, **extra: str) -> Any:
        """`metric`'s child for this view's labels (and `extra`), looked up once (`labels()` validates and
        locks on every call: a dozen calls a step)."""
        key = (metric, *extra.values())
        child = self._children.get(key)
        if child is None:
            child = self._children[key] = metric.labels(model_name=self.model_name, engine=self.engine, **extra)
        return child

    def record(self, scheduler_stats: SchedulerStats, iteration_stats: IterationStats) -> None:
        label = self._label
        s = scheduler_stats
        label(self.num_requests_running).set(s.num_running_reqs)
        label(self.num_requests_waiting).set(s.num_waiting_reqs)
        label(self.num_requests_swapped).set(s.num_swapped_reqs)
        label(self.gpu_cache_usage).set(s.kv_cache_usage)
        label(self.kv_cache_usage).set(s.kv_cache_usage)
        for counter, delta in ((self.prefix_cache_queries, s.prefix_cache_queries),
                               (self.prefix_cache_hits, s.prefix_cache_hits),
                               (self.num_preemptions, s.num_preemptions)):
            if delta:
                label(counter).inc(delta)

        it = iteration_stats
        if it.num_prompt_tokens:
            label(self.prompt_tokens).inc(it.num_prompt_tokens)
        if it.num_generation_tokens:
            label(self.generation_tokens).inc(it.num_generation_tokens)
        if it.num_prompt_tokens or it.num_generation_tokens:
            label(self.iteration_tokens).observe(it.num_prompt_tokens + it.num_generation_tokens)
        if it.time_to_first_tokens:
            ttft = label(self.time_to_first_token)
            for value in it.time_to_first_tokens:
                ttft.observe(value)
        if it.inter_token_latencies:
            itl, tpot = label(self.inter_token_latency), label(self.time_per_output_token)
            for value in it.inter_token_latencies:
                itl.observe(value)
                tpot.observe(value)
        for req in it.finished_requests:
            self._record_finished(req)
        if self.spec_decode is not None:
            self.spec_decode.record(s.spec_decoding)
        if self.lora is not None:
            self.lora.record_adapters(s.running_lora_adapters, s.waiting_lora_adapters)
            for req in it.finished_requests:
                self.lora.record_finished(req)

    def _record_finished(self, req: Any) -> None:
        label = self._label
        if req.finish_reason in ("stop", "length"):
            label(self.request_success, finished_reason=req.finish_reason).inc()
            label(self.request_process_success).inc()
        else:
            label(self.request_failure, reason=req.finish_reason).inc()
            label(self.request_process_fail).inc()
        label(self.request_prompt_tokens).observe(req.num_prompt_tokens)
        label(self.request_generation_tokens).observe(req.num_generation_tokens)
        label(self.request_params_n).observe(req.n)
        if req.max_tokens_param is not None:
            label(self.request_params_max_tokens).observe(req.max_tokens_param)
        label(self.e2e_latency).observe(req.e2e_latency)
        label(self.queue_time).observe(req.queue_time)
        label(self.inference_time).observe(req.inference_time)
        label(self.inference_compute).observe(req.inference_time)
        label(self.request_max_num_generation_tokens).observe(req.max_num_generation_tokens)
        label(self.prefill_time).observe(req.prefill_time)
        label(self.decode_time).observe(req.decode_time)
        if req.num_generation_tokens > 1:
            label(self.request_time_per_output_token).observe(req.mean_time_per_output_token)

    def record_rejected(self, reason: str) -> None:
        """A request the server refused before it reached the engine (bad input, draining, ...)."""
        self._label(self.request_failure, reason=reason).inc()
        self._label(self.request_process_fail).inc()

    def render(self) -> bytes:
        return generate_latest(self.registry)


class LoggingStatLogger(StatLineLogger):
    """The engine's stats line (aserve.engine.stats.StatLineLogger), logged by a timer task every
    `interval` seconds under the server's logger name."""

    def __init__(
        self,
        interval: float = 5.0,
        clock: Callable[[], float] = time.monotonic,
        log: Callable[[str], None] | None = None,
    ):
        super().__init__(interval, clock, log or logger.info)

    async def run(self, *, task_status: TaskStatus[None] = anyio.TASK_STATUS_IGNORED) -> None:
        """Log every `interval` seconds until cancelled."""
        task_status.started()
        while True:
            await anyio.sleep(self.interval)
            self.log_line()
