"""Seed 004's vendor metrics, `--metrics-prefix`, `cache_config_info`, the preemption warning and
`usage.prompt_tokens_details` (`--enable-prompt-tokens-details`): unit checks on the stat loggers,
then a real tiny server."""

from __future__ import annotations

import logging
import re

import anyio
import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from aserve.config.schema import CacheConfig
from aserve.engine.stats import FinishedRequestStats, IterationStats, PreemptionWarner, SchedulerStats
from aserve.server.args import parse_args
from aserve.server.metrics import PrometheusStatLogger
from tests.server.real_tiny_server import build_tiny_chat_model, serving
from tests.server.server_harness import quiet_args
from tests.support.metrics_labels import without_engine_zero

pytestmark = pytest.mark.timeout(300)


def _samples(text: str) -> dict[tuple[str, tuple], float]:
    return {(s.name, tuple(sorted(without_engine_zero(s.labels).items()))): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def _finished(reason: str, generated: int, max_per_sample: int, lora: str | None = None) -> FinishedRequestStats:
    return FinishedRequestStats(
        finish_reason=reason, e2e_latency=2.0, num_prompt_tokens=5, num_generation_tokens=generated,
        max_tokens_param=16, n=2, queue_time=0.1, prefill_time=0.2, decode_time=1.0, inference_time=1.25,
        mean_time_per_output_token=0.5, lora_name=lora, max_num_generation_tokens=max_per_sample)


def test_vendor_counters_and_histograms():
    p = PrometheusStatLogger("m", 1024)
    m = (("model_name", "m"),)
    for _ in range(4):
        p.record_received()
    p.record(SchedulerStats(), IterationStats(finished_requests=[
        _finished("stop", 9, 5), _finished("length", 4, 2), _finished("abort", 3, 3)]))
    p.record_rejected("invalid_request")
    s = _samples(p.render().decode())
    assert s[("vllm:request_total", m)] == 4
    assert s[("vllm:request_process_success_total", m)] == 2  # stop and length
    assert s[("vllm:request_process_fail_total", m)] == 2  # the abort and the rejected one
    assert s[("vllm:inference_compute_infer_duration_count", m)] == 3
    assert s[("vllm:inference_compute_infer_duration_sum", m)] == 3 * 1.25
    assert s[("vllm:request_max_num_generation_tokens_sum", m)] == 5 + 2 + 3
    assert s[("vllm:request_max_num_generation_tokens_bucket", (("le", "2.0"),) + m)] == 1


def test_cache_config_info_labels():
    p = PrometheusStatLogger("m", 64)
    p.record_cache_config(CacheConfig(block_size=16, enable_prefix_caching=True, kv_cache_dtype="auto",
                                      swap_space_gb=4.0, gpu_memory_utilization=0.9), 64, 8)
    [(_name, labels)] = [k for k in _samples(p.render().decode()) if k[0] == "vllm:cache_config_info"]
    labels = dict(labels)
    assert labels["model_name"] == "m" and labels["block_size"] == "16"
    assert (labels["num_gpu_blocks"], labels["num_cpu_blocks"]) == ("64", "8")
    assert labels["cache_dtype"] == "auto" and labels["enable_prefix_caching"] == "True"
    assert labels["gpu_memory_utilization"] == "0.9" and labels["swap_space"] == "4.0"


def test_prefix_applies_to_every_module():
    for prefix in ("vllm", "aserve"):
        p = PrometheusStatLogger("m", 64, max_loras=2, num_speculative_tokens=2, prefix=prefix)
        p.record(SchedulerStats(), IterationStats(finished_requests=[_finished("stop", 3, 3, lora="sql")]))
        names = {f.name for f in text_string_to_metric_families(p.render().decode())}
        assert names and all(n.startswith(f"{prefix}:") for n in names), names
        for name in ("lora_count", "lora_time_e2e_requests", "lora_requests_info", "spec_decode_num_drafts",
                     "request", "request_process_success", "num_requests_running"):
            assert f"{prefix}:{name}" in names, name
    with pytest.raises(ValueError, match="metrics prefix"):
        PrometheusStatLogger("m", 64, prefix="tgi")


def test_flags_parse():
    _, server = parse_args(["--model", "x"])
    assert server.metrics_prefix == "vllm" and not server.enable_prompt_tokens_details
    _, server = parse_args(["--model", "x", "--metrics-prefix", "aserve", "--enable-prompt-tokens-details"])
    assert server.metrics_prefix == "aserve" and server.enable_prompt_tokens_details


def test_preemption_warning_is_rate_limited():
    lines: list[str] = []
    w = PreemptionWarner("recompute", every=50, log=lines.append)
    w.record(0)
    assert lines == []
    w.record(1)
    assert len(lines) == 1 and "total_num_cumulative_preemption=1" in lines[0] and "RECOMPUTE" in lines[0]
    for _ in range(49):
        w.record(1)
    assert len(lines) == 1  # 2..50: quiet
    w.record(3)  # 51..53
    assert len(lines) == 2 and "total_num_cumulative_preemption=53" in lines[1]


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory):
    return build_tiny_chat_model(tmp_path_factory.mktemp("tiny_vendor"))


def test_live_prefix_counters_and_cached_tokens(tiny_model):
    args = quiet_args(metrics_prefix="aserve", enable_prompt_tokens_details=True)
    prompt = "The quick brown fox jumps over the lazy dog. " * 3
    with serving(tiny_model, args, enable_prefix_caching=True, block_size=16) as (_e, address), \
            httpx.Client(base_url=address.url, timeout=60) as http:
        first = http.post("/v1/completions", json={"prompt": prompt, "max_tokens": 2}).json()["usage"]
        second = http.post("/v1/completions", json={"prompt": prompt, "max_tokens": 2}).json()["usage"]
        chat = http.post("/v1/chat/completions", json={
            "messages": [{"role": "user", "content": prompt}], "max_tokens": 2}).json()["usage"]
        chat_again = http.post("/v1/chat/completions", json={
            "messages": [{"role": "user", "content": prompt}], "max_tokens": 2, "stream": True,
            "stream_options": {"include_usage": True}}).text
        bad = http.post("/v1/completions", json={"prompt": prompt, "max_tokens": -1})
        text = http.get("/metrics").text
    assert first["prompt_tokens_details"] == {"cached_tokens": 0}
    cached = second["prompt_tokens_details"]["cached_tokens"]
    assert cached == (second["prompt_tokens"] - 1) // 16 * 16 and cached > 0  # full blocks, the last token recomputed
    assert chat["prompt_tokens_details"]["cached_tokens"] == 0
    last_usage = re.findall(r'"prompt_tokens_details":\{"cached_tokens":(\d+)\}', chat_again)[-1]
    assert int(last_usage) == (chat["prompt_tokens"] - 1) // 16 * 16
    assert bad.status_code == 400
    s = _samples(text)
    m = (("model_name", next(k[1] for k in s if k[0] == "aserve:request_total")[0][1]),)
    assert not any(name.startswith("vllm:") for name, _ in s)
    assert s[("aserve:request_total", m)] == 5
    assert s[("aserve:request_process_success_total", m)] == 4
    assert s[("aserve:request_process_fail_total", m)] == 1
    assert s[("aserve:inference_compute_infer_duration_count", m)] == 4
    assert s[("aserve:request_max_num_generation_tokens_sum", m)] == 8
    assert s[("aserve:prefix_cache_hits_total", m)] >= cached
    info = [dict(k[1]) for k in s if k[0] == "aserve:cache_config_info"]
    assert len(info) == 1 and info[0]["block_size"] == "16" and info[0]["enable_prefix_caching"] == "True"
    assert info[0]["num_gpu_blocks"] == "63"  # the 64 allocated less the reserved null block: the usable ones


def test_live_default_has_no_prompt_tokens_details(tiny_model):
    with serving(tiny_model, quiet_args()) as (_e, address), httpx.Client(base_url=address.url, timeout=60) as http:
        usage = http.post("/v1/completions", json={"prompt": "Hello", "max_tokens": 2}).json()["usage"]
        text = http.get("/metrics").text
    assert "prompt_tokens_details" not in usage
    assert "vllm:request_total{" in text and "aserve:" not in text


class _Collect(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


def test_live_preemption_is_counted_and_warned(tiny_model):
    handler = _Collect()
    engine_logger = logging.getLogger("aserve.engine")
    engine_logger.addHandler(handler)
    try:
        # 6 blocks of 16 tokens: four 60-token generations cannot all stay resident
        with serving(tiny_model, quiet_args(), num_gpu_blocks_override=6, block_size=16, max_model_len=64,
                     enable_prefix_caching=False) as (_e, address):
            async def one(client: httpx.AsyncClient, i: int) -> None:
                r = await client.post("/v1/completions", json={
                    "prompt": [5 + i, 6, 7, 8], "max_tokens": 56, "ignore_eos": True})
                assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 56

            async def main() -> str:
                async with httpx.AsyncClient(base_url=address.url, timeout=120) as client:
                    async with anyio.create_task_group() as tg:
                        for i in range(4):
                            tg.start_soon(one, client, i)
                    return (await client.get("/metrics")).text

            text = anyio.run(main)
    finally:
        engine_logger.removeHandler(handler)
    preemptions = sum(v for (name, _), v in _samples(text).items() if name == "vllm:num_preemptions_total")
    assert preemptions >= 1
    warnings = [msg for msg in handler.messages if "not enough KV cache space" in msg]
    assert len(warnings) == 1  # the first preemption step warns; the next 49 stay quiet
    assert 1 <= int(re.search(r"total_num_cumulative_preemption=(\d+)", warnings[0])[1]) <= preemptions


def test_live_aborted_stream_counts_as_a_failure_once(tiny_model):
    """A client that leaves a stream after its first chunk: the request is aborted, and the abort reaches
    request_process_fail_total and request_failure_total{reason=abort} (once), like any finish."""
    import time

    with serving(tiny_model, quiet_args()) as (engine, address), \
            httpx.Client(base_url=address.url, timeout=60) as http:
        name = http.get("/v1/models").json()["data"][0]["id"]
        body = {"model": name, "prompt": "hello there", "max_tokens": 120, "stream": True, "ignore_eos": True}
        with http.stream("POST", "/v1/completions", json=body) as r:
            next(r.iter_lines())  # the first chunk, then the client leaves
        for _ in range(100):
            samples = _samples(http.get("/metrics").text)
            fail = samples.get(("vllm:request_process_fail_total", (("model_name", name),)), 0)
            if fail:
                break
            time.sleep(0.05)
        abort = samples.get(("vllm:request_failure_total", (("model_name", name), ("reason", "abort"))), 0)
        assert (fail, abort) == (1, 1)
        assert samples[("vllm:request_total", (("model_name", name),))] == 1
