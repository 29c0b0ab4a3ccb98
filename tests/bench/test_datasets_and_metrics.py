"""aserve.bench's pure parts: seeded datasets, gamma arrivals, vLLM's metric fields against hand values."""

from __future__ import annotations

import json
import math
import statistics

import numpy as np
import pytest

from aserve.bench.client import RequestResult, RequestSpec, build_body
from aserve.bench.datasets import SampleRequest, random_requests, sharegpt_requests
from aserve.bench.metrics import arrival_intervals, percentile_summary, serve_metrics


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    from transformers import AutoTokenizer

    from tests.server.real_tiny_server import build_tiny_chat_model

    return AutoTokenizer.from_pretrained(build_tiny_chat_model(tmp_path_factory.mktemp("tok")))


def test_random_dataset_is_seeded_and_has_the_asked_lengths(tokenizer):
    a = random_requests(tokenizer, 6, input_len=40, output_len=7, seed=3)
    assert a == random_requests(tokenizer, 6, input_len=40, output_len=7, seed=3)
    assert [r.prompt for r in a] != [r.prompt for r in random_requests(tokenizer, 6, 40, 7, seed=4)]
    assert len({r.prompt for r in a}) == 6
    for r in a:
        assert r.expected_output_len == 7
        assert r.prompt_len == len(tokenizer.encode(r.prompt, add_special_tokens=False))
        assert abs(r.prompt_len - 40) <= 2  # decode/encode may merge a pair at a seam
        assert not set(tokenizer.all_special_tokens) & set(r.prompt.split())


def test_random_dataset_range_ratio_bounds_lengths(tokenizer):
    reqs = random_requests(tokenizer, 40, input_len=20, output_len=10, range_ratio=0.5, seed=0)
    outs = [r.expected_output_len for r in reqs]
    assert min(outs) >= 5 and max(outs) <= 15 and len(set(outs)) > 3
    with pytest.raises(ValueError, match="--random-range-ratio"):
        random_requests(tokenizer, 1, 10, 10, range_ratio=1.0)


def test_sharegpt_takes_first_two_turns_and_filters(tokenizer, tmp_path):
    long = "The quick brown fox jumps over the lazy dog. " * 3
    data = [{"conversations": [{"from": "human", "value": f"{long} question {i}"},
                               {"from": "gpt", "value": long}]} for i in range(5)]
    data += [{"conversations": [{"from": "human", "value": "hi"}, {"from": "gpt", "value": long}]},  # < 4 tokens
             {"conversations": [{"from": "human", "value": long}]}]  # one turn
    path = tmp_path / "sg.json"
    path.write_text(json.dumps(data))
    reqs = sharegpt_requests(str(path), tokenizer, 5, seed=1)
    assert sorted(r.prompt for r in reqs) == sorted(d["conversations"][0]["value"] for d in data[:5])
    assert all(r.expected_output_len == len(tokenizer.encode(long, add_special_tokens=False)) for r in reqs)
    assert [r.prompt for r in reqs] == [r.prompt for r in sharegpt_requests(str(path), tokenizer, 5, seed=1)]
    assert all(r.expected_output_len == 9 for r in sharegpt_requests(str(path), tokenizer, 5, 9))
    with pytest.raises(ValueError, match="only 5 usable"):
        sharegpt_requests(str(path), tokenizer, 6)
    with pytest.raises(ValueError, match="only 5 usable"):  # a fixed output length keeps the prompt checks
        sharegpt_requests(str(path), tokenizer, 6, 9)


@pytest.mark.parametrize("burstiness", [1.0, 4.0, 0.25])
def test_gamma_arrivals_have_mean_one_over_rate_and_cv_one_over_sqrt_burstiness(burstiness):
    gaps = arrival_intervals(20000, request_rate=8.0, burstiness=burstiness, seed=5)
    mean = statistics.fmean(gaps)
    assert mean == pytest.approx(1 / 8.0, rel=0.05)
    assert statistics.pstdev(gaps) / mean == pytest.approx(1 / math.sqrt(burstiness), rel=0.05)
    assert gaps == arrival_intervals(20000, 8.0, burstiness, seed=5)


def test_infinite_rate_sends_at_once_and_bad_rates_are_refused():
    assert arrival_intervals(3, math.inf) == [0.0, 0.0, 0.0]
    with pytest.raises(ValueError):
        arrival_intervals(3, 0.0)
    with pytest.raises(ValueError):
        arrival_intervals(3, 1.0, burstiness=0.0)


def _results() -> tuple[list[SampleRequest], list[RequestResult]]:
    reqs = [SampleRequest("a", 10, 4), SampleRequest("b", 20, 4), SampleRequest("c", 30, 4)]
    # request 1: ttft 0.1, chunks at 0.1, 0.3, 0.4, 0.6 after a start at 0; e2e 0.7, 4 tokens
    r1 = RequestResult(ok=True, start=0.0, ttft=0.1, e2e=0.7, output_tokens=4, prompt_tokens=11,
                       chunk_times=[0.1, 0.3, 0.4, 0.6])
    # request 2: ttft 0.3, two chunks 0.2 apart; e2e 0.5, 3 tokens (the usage says so)
    r2 = RequestResult(ok=True, start=0.0, ttft=0.3, e2e=0.5, output_tokens=3, chunk_times=[0.3, 0.5])
    r3 = RequestResult(ok=False, output_tokens=9, error="HTTP 500")
    return reqs, [r1, r2, r3]


def test_serve_metrics_match_hand_computed_values_and_vllm_names():
    reqs, results = _results()
    m = serve_metrics(reqs, results, duration=2.0, percentile_metrics=("ttft", "tpot", "itl", "e2el"),
                      metric_percentiles=(50.0, 90.0, 99.0, 99.9))
    assert m["completed"] == 2 and m["failed"] == 1
    assert m["total_input_tokens"] == 11 + 20  # the usage's prompt_tokens where sent, else the dataset's
    assert m["total_output_tokens"] == 7
    assert m["request_throughput"] == pytest.approx(1.0)
    assert m["output_throughput"] == pytest.approx(3.5)
    assert m["total_token_throughput"] == pytest.approx((31 + 7) / 2)
    assert m["mean_ttft_ms"] == pytest.approx(200.0) and m["median_ttft_ms"] == pytest.approx(200.0)
    assert m["std_ttft_ms"] == pytest.approx(100.0)  # population std of (100, 300)
    assert m["p90_ttft_ms"] == pytest.approx(100 + 0.9 * 200)
    tpots = [(0.7 - 0.1) / 3, (0.5 - 0.3) / 2]
    assert m["mean_tpot_ms"] == pytest.approx(1000 * sum(tpots) / 2)
    itls = [200.0, 100.0, 200.0, 200.0]  # ms
    assert m["mean_itl_ms"] == pytest.approx(175.0) and m["median_itl_ms"] == pytest.approx(200.0)
    assert m["p50_itl_ms"] == pytest.approx(float(np.percentile(itls, 50)))
    assert m["p99.9_e2el_ms"] == pytest.approx(float(np.percentile([700.0, 500.0], 99.9)))
    assert m["output_lens"] == [4, 3, 0] and m["input_lens"] == [10, 20, 30]
    assert m["errors"] == ["", "", "HTTP 500"]
    for name in ("duration", "completed", "total_input_tokens", "total_output_tokens", "request_throughput",
                 "output_throughput", "total_token_throughput", "ttfts", "itls", "generated_texts"):
        assert name in m
    only = serve_metrics(reqs, results, 2.0, ("itl",), (99.0,))
    assert not any("ttft_ms" in k for k in only) and "p99_itl_ms" in only


def test_empty_metrics_report_zero_as_vllm():
    m = serve_metrics([SampleRequest("a", 5, 1)], [RequestResult(ok=False, error="x")], 1.0)
    assert m["completed"] == 0 and m["mean_ttft_ms"] == 0.0 and m["p99_itl_ms"] == 0.0


def test_compact_summary_keeps_its_shape():
    assert percentile_summary([]) == {"mean": None, "p50": None, "p90": None, "p99": None}
    s = percentile_summary([1.0, 2.0, 3.0, 4.0, 5.0])
    assert s == {"mean": 3.0, "p50": 3.0, "p90": pytest.approx(4.6), "p99": pytest.approx(4.96)}


def test_request_body_per_backend():
    chat = build_body(RequestSpec(path="/v1/chat/completions", chat=True, ignore_eos=True), "m", "hi", 5)
    assert chat["messages"] == [{"role": "user", "content": "hi"}] and chat["max_tokens"] == 5
    assert chat["ignore_eos"] is True and chat["stream_options"] == {"include_usage": True}
    plain = build_body(RequestSpec(), "m", "hi")
    assert plain["prompt"] == "hi" and "ignore_eos" not in plain and plain["max_tokens"] == 128
