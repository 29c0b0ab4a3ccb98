"""PrometheusStatLogger and LoggingStatLogger fed with plain stats records."""

from __future__ import annotations

from prometheus_client.parser import text_string_to_metric_families

from aserve.engine.stats import FinishedRequestStats, IterationStats, SchedulerStats
from aserve.server.metrics import LoggingStatLogger, PrometheusStatLogger, token_buckets
from tests.support.metrics_labels import without_engine_zero


def _samples(logger: PrometheusStatLogger) -> dict[tuple[str, tuple], float]:
    out = {}
    for family in text_string_to_metric_families(logger.render().decode()):
        for s in family.samples:
            out[(s.name, tuple(sorted(without_engine_zero(s.labels).items())))] = s.value
    return out


def _finished(reason: str, prompt: int = 5, generated: int = 3) -> FinishedRequestStats:
    return FinishedRequestStats(
        finish_reason=reason,
        e2e_latency=1.5,
        num_prompt_tokens=prompt,
        num_generation_tokens=generated,
        max_tokens_param=16,
        n=2,
        queue_time=0.1,
        prefill_time=0.2,
        decode_time=1.0,
        inference_time=1.2,
        mean_time_per_output_token=0.5,
    )


def test_token_buckets():
    assert token_buckets(100) == [1, 2, 5, 10, 20, 50, 100]


def test_prometheus_logger_records_everything():
    p = PrometheusStatLogger("m", 1024)
    m = (("model_name", "m"),)
    before = _samples(p)
    assert before[("vllm:prompt_tokens_total", m)] == 0  # series exist before any request
    p.record(
        SchedulerStats(
            num_running_reqs=3,
            num_waiting_reqs=2,
            num_swapped_reqs=1,
            kv_cache_usage=0.25,
            prefix_cache_queries=100,
            prefix_cache_hits=40,
            num_preemptions=2,
        ),
        IterationStats(
            num_prompt_tokens=10,
            num_generation_tokens=4,
            time_to_first_tokens=[0.05, 0.07],
            inter_token_latencies=[0.01, 0.02, 0.03],
            finished_requests=[_finished("stop"), _finished("length"), _finished("abort")],
        ),
    )
    # the scheduler's counters are per-step deltas: each record adds its own
    p.record(SchedulerStats(prefix_cache_queries=50, prefix_cache_hits=5), IterationStats())
    s = _samples(p)
    assert s[("vllm:num_requests_running", m)] == 0  # the latest snapshot
    assert s[("vllm:prefix_cache_queries_total", m)] == 150
    assert s[("vllm:prefix_cache_hits_total", m)] == 45
    assert s[("vllm:num_preemptions_total", m)] == 2
    assert s[("vllm:prompt_tokens_total", m)] == 10
    assert s[("vllm:generation_tokens_total", m)] == 4
    assert s[("vllm:request_success_total", (("finished_reason", "stop"), ("model_name", "m")))] == 1
    assert s[("vllm:request_success_total", (("finished_reason", "length"), ("model_name", "m")))] == 1
    assert s[("vllm:request_failure_total", (("model_name", "m"), ("reason", "abort")))] == 1
    assert s[("vllm:time_to_first_token_seconds_count", m)] == 2
    assert s[("vllm:inter_token_latency_seconds_count", m)] == 3
    assert s[("vllm:time_per_output_token_seconds_count", m)] == 3
    assert s[("vllm:e2e_request_latency_seconds_count", m)] == 3
    assert s[("vllm:request_prompt_tokens_sum", m)] == 15
    assert s[("vllm:request_generation_tokens_sum", m)] == 9
    assert s[("vllm:request_params_n_sum", m)] == 6
    assert s[("vllm:request_params_max_tokens_sum", m)] == 48
    for name in (
        "request_queue_time_seconds",
        "request_inference_time_seconds",
        "request_prefill_time_seconds",
        "request_decode_time_seconds",
        "request_time_per_output_token_seconds",
    ):
        assert s[(f"vllm:{name}_count", m)] == 3, name
    p.record(SchedulerStats(num_running_reqs=3, kv_cache_usage=0.5), IterationStats())
    s = _samples(p)
    assert s[("vllm:num_requests_running", m)] == 3
    assert s[("vllm:gpu_cache_usage_perc", m)] == 0.5 == s[("vllm:kv_cache_usage_perc", m)]
    p.record_rejected("invalid_request")
    assert (
        _samples(p)[("vllm:request_failure_total", (("model_name", "m"), ("reason", "invalid_request")))]
        == 1
    )


def test_registries_are_per_instance():
    a, b = PrometheusStatLogger("a", 64), PrometheusStatLogger("b", 64)
    a.record(SchedulerStats(), IterationStats(num_generation_tokens=7))
    assert _samples(b)[("vllm:generation_tokens_total", (("model_name", "b"),))] == 0


def test_logging_stat_logger_line():
    now = [100.0]
    lines = []
    logger = LoggingStatLogger(interval=5.0, clock=lambda: now[0], log=lines.append)
    assert logger.format_line() is None  # idle: no line
    logger.record(
        SchedulerStats(
            num_running_reqs=4,
            num_waiting_reqs=1,
            kv_cache_usage=0.125,
            prefix_cache_queries=200,
            prefix_cache_hits=50,
        ),
        IterationStats(num_prompt_tokens=100, num_generation_tokens=40),
    )
    logger.record(
        SchedulerStats(
            num_running_reqs=4,
            num_waiting_reqs=1,
            kv_cache_usage=0.125,
            prefix_cache_queries=200,
            prefix_cache_hits=50,
        ),
        IterationStats(num_generation_tokens=10),
    )
    now[0] += 10.0
    line = logger.format_line()
    assert "Avg prompt throughput: 10.0 tokens/s" in line
    assert "Avg generation throughput: 5.0 tokens/s" in line
    assert "Running: 4 reqs, Waiting: 1 reqs" in line
    assert "KV cache usage: 12.5%" in line
    assert "Prefix cache hit rate: 25.0%" in line
    now[0] += 5.0
    line = logger.format_line()  # still running requests: a line, with zero throughput and no new lookups
    assert "Avg generation throughput: 0.0 tokens/s" in line and "Prefix cache hit rate: 0.0%" in line


def test_each_replica_records_under_its_engine_label():
    p = PrometheusStatLogger("m", 1024)
    replica = p.for_engine(1)
    assert _samples(p)[("vllm:generation_tokens_total", (("engine", "1"), ("model_name", "m")))] == 0  # exposed
    replica.record(SchedulerStats(num_running_reqs=4), IterationStats(num_generation_tokens=7))
    p.record(SchedulerStats(num_running_reqs=1), IterationStats(num_generation_tokens=2))
    s = _samples(p)
    assert s[("vllm:generation_tokens_total", (("engine", "1"), ("model_name", "m")))] == 7
    assert s[("vllm:generation_tokens_total", (("model_name", "m"),))] == 2  # engine "0"
    assert s[("vllm:num_requests_running", (("engine", "1"), ("model_name", "m")))] == 4
    assert s[("vllm:num_requests_running", (("model_name", "m"),))] == 1
