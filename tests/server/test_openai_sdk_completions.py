"""The official `openai` SDK against a real server on 127.0.0.1 (the real engine over a fake model):
completions, tokenize / detokenize, metrics, API key. Chat is in test_openai_sdk.py."""

from __future__ import annotations

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.server.server_harness import (
    CHATML_USER,
    MODEL,
    expected_text,
    last_added,
    quiet_args,
    recording_engine,
    running_server,
)

pytestmark = pytest.mark.timeout(60)


def test_completions_sync(client, engine, tokenizer, fake_model):
    resp = client.completions.create(model=MODEL, prompt="hello world", max_tokens=5, temperature=0)
    prompt_ids, params = last_added(engine)
    assert prompt_ids == tokenizer.encode("hello world")
    assert resp.choices[0].text == expected_text(fake_model, tokenizer, prompt_ids, params)
    assert resp.object == "text_completion"
    assert resp.usage.prompt_tokens == len(prompt_ids) and resp.usage.completion_tokens == 5


def test_completions_prompt_forms(client, tokenizer):
    ids = tokenizer.encode("one two three")
    by_text = client.completions.create(model=MODEL, prompt="one two three", max_tokens=3, temperature=0)
    by_ids = client.completions.create(model=MODEL, prompt=ids, max_tokens=3, temperature=0)
    assert by_ids.choices[0].text == by_text.choices[0].text
    many = client.completions.create(
        model=MODEL, prompt=["one two three", "red green"], max_tokens=3, temperature=0, n=2
    )
    assert [c.index for c in many.choices] == [0, 1, 2, 3]
    assert many.choices[0].text == by_text.choices[0].text
    assert many.usage.prompt_tokens == len(ids) + len(tokenizer.encode("red green"))
    id_lists = client.completions.create(
        model=MODEL, prompt=[ids, tokenizer.encode("red green")], max_tokens=3, temperature=0
    )
    assert [c.text for c in id_lists.choices] == [many.choices[0].text, many.choices[2].text]


def test_completions_echo_logprobs(client, tokenizer):
    resp = client.completions.create(
        model=MODEL, prompt="hello world", max_tokens=3, logprobs=2, echo=True, temperature=0
    )
    lp = resp.choices[0].logprobs
    prompt_len = len(tokenizer.encode("hello world"))
    assert resp.choices[0].text.startswith("hello world")
    assert len(lp.tokens) == prompt_len + 3
    assert "".join(lp.tokens) == resp.choices[0].text
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    assert all(v is not None for v in lp.token_logprobs[1:])
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(len(lp.tokens))]
    assert all(len(d) >= 2 for d in lp.top_logprobs[prompt_len:])


def test_completions_best_of_returns_the_n_most_likely(client, engine, tokenizer, fake_model):
    resp = client.completions.create(model=MODEL, prompt="pick", max_tokens=3, n=2, best_of=4, seed=1)
    prompt_ids, params = last_added(engine)
    assert [c.index for c in resp.choices] == [0, 1]

    def cumulative_logprob(index: int) -> float:
        tokens = list(prompt_ids)
        total = 0.0
        for t in fake_model.expected_token_ids(prompt_ids, params, index):
            total += fake_model.logprobs(tokens, t, 0).logprobs[0]
            tokens.append(t)
        return total

    best = sorted(range(4), key=cumulative_logprob, reverse=True)[:2]
    expected = [expected_text(fake_model, tokenizer, prompt_ids, params, i) for i in best]
    assert [c.text for c in resp.choices] == expected


def test_completions_stream(client):
    full = client.completions.create(model=MODEL, prompt=["the cat", "the dog"], max_tokens=4, temperature=0)
    chunks = list(
        client.completions.create(
            model=MODEL,
            prompt=["the cat", "the dog"],
            max_tokens=4,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    texts = {0: "", 1: ""}
    finish = {}
    for ch in chunks:
        for c in ch.choices:
            texts[c.index] += c.text
            if c.finish_reason:
                finish[c.index] = c.finish_reason
    assert texts == {c.index: c.text for c in full.choices}
    assert finish == {0: "length", 1: "length"}
    assert chunks[-1].usage.completion_tokens == 8


def test_tokenize_detokenize_round_trip(server, tokenizer):
    with httpx.Client(base_url=server.url) as http:
        text = "the quick brown fox, wörld!"
        tok = http.post("/tokenize", json={"model": MODEL, "prompt": text}).json()
        assert tok["tokens"] == tokenizer.encode(text)
        assert tok["count"] == len(tok["tokens"]) and tok["max_model_len"] == 256
        back = http.post("/detokenize", json={"model": MODEL, "tokens": tok["tokens"]}).json()
        assert back == {"prompt": text}
        chat = http.post("/tokenize", json={"messages": [{"role": "user", "content": "hi"}]}).json()
        assert chat["tokens"] == tokenizer.encode(CHATML_USER.format("hi"), add_special_tokens=False)
        strs = http.post("/tokenize", json={"prompt": "hello", "return_token_strs": True}).json()
        assert len(strs["token_strs"]) == strs["count"]


def _metrics(http: httpx.Client) -> dict[str, float]:
    text = http.get("/metrics").text
    values: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            labels = ",".join(f"{k}={v}" for k, v in sorted(sample.labels.items()) if k not in ("model_name", "engine"))
            key = sample.name + (f"{{{labels}}}" if labels else "")
            values[key] = values.get(key, 0.0) + sample.value
            assert sample.labels.get("model_name", "fake-model") == "fake-model"
    return values


def test_metrics_counters_move(client, server):
    with httpx.Client(base_url=server.url) as http:
        before = _metrics(http)
        for _ in range(3):
            client.completions.create(model=MODEL, prompt="metrics please", max_tokens=4)
        client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "m"}], max_tokens=2, stop=None
        )
        http.post("/v1/completions", json={"prompt": "x", "temperature": -1})
        after = _metrics(http)
    key = "vllm:request_success_total{finished_reason=length}"
    assert after[key] - before.get(key, 0) == 4
    assert after["vllm:generation_tokens_total"] - before["vllm:generation_tokens_total"] == 14
    assert after["vllm:prompt_tokens_total"] > before["vllm:prompt_tokens_total"]
    assert (
        after["vllm:e2e_request_latency_seconds_count"] - before["vllm:e2e_request_latency_seconds_count"]
        == 4
    )
    assert (
        after["vllm:request_generation_tokens_sum"] - before["vllm:request_generation_tokens_sum"] == 14
    )
    assert (
        after["vllm:time_to_first_token_seconds_count"] > before["vllm:time_to_first_token_seconds_count"]
    )
    assert after["vllm:request_failure_total{reason=invalid_request}"] >= 1
    for name in (
        "vllm:num_requests_running",
        "vllm:num_requests_waiting",
        "vllm:num_requests_swapped",
        "vllm:gpu_cache_usage_perc",
        "vllm:kv_cache_usage_perc",
        "vllm:prefix_cache_queries_total",
        "vllm:prefix_cache_hits_total",
        "vllm:num_preemptions_total",
        "vllm:request_params_n_count",
        "vllm:request_params_max_tokens_count",
        "vllm:inter_token_latency_seconds_count",
        "vllm:time_per_output_token_seconds_count",
        "vllm:request_queue_time_seconds_count",
        "vllm:request_inference_time_seconds_count",
        "vllm:request_prefill_time_seconds_count",
        "vllm:request_decode_time_seconds_count",
        "vllm:request_prompt_tokens_count",
    ):
        assert name in after, name


def test_api_key(model_folder, fake_model):
    make = lambda: recording_engine(model_folder, fake_model)  # noqa: E731
    with running_server(make, quiet_args(api_key="sekret")) as address:
        with openai.OpenAI(base_url=f"{address.url}/v1", api_key="wrong", max_retries=0) as bad:
            with pytest.raises(openai.AuthenticationError) as info:
                bad.models.list()
            assert info.value.status_code == 401
            assert info.value.body["code"] == "invalid_api_key"
        with openai.OpenAI(base_url=f"{address.url}/v1", api_key="sekret", max_retries=0) as good:
            assert good.completions.create(model=MODEL, prompt="hi", max_tokens=2).choices[0].text
        with httpx.Client(base_url=address.url) as http:
            assert http.post("/v1/completions", json={"prompt": "hi"}).status_code == 401
            assert http.get("/health").status_code == 200
            assert http.get("/metrics").status_code == 200
            preflight = http.options(
                "/v1/chat/completions",
                headers={
                    "Origin": "http://example.test",
                    "Access-Control-Request-Method": "POST",
                    "Access-Control-Request-Headers": "authorization, content-type",
                },
            )
            assert preflight.status_code == 200
            assert preflight.headers["access-control-allow-origin"] in ("*", "http://example.test")
