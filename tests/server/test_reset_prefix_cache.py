"""POST /reset_prefix_cache (vLLM's endpoint) on a live server with an API key set.

The HTTP contract (key required, 200 / 409) is checked with the engine's `reset_prefix_cache`
replaced by an observed stand-in; the effect on the real engine (cached prefixes really forgotten)
is checked with `AsyncEngine.reset_prefix_cache` itself.
"""

from __future__ import annotations

import re
import time

import httpx
import pytest
from tests.server.real_tiny_server import build_tiny_chat_model, serving
from tests.server.server_harness import quiet_args


KEY = "sk-test"
pytestmark = pytest.mark.timeout(300)


@pytest.fixture(scope="module")
def live(tmp_path_factory):
    model = build_tiny_chat_model(tmp_path_factory.mktemp("tiny_chat"))
    with serving(model, quiet_args(api_key=KEY)) as (engine, address):
        yield engine, address


@pytest.fixture
def observed(live, monkeypatch):
    """The engine's reset replaced by one that records its calls and answers `observed.answer`."""
    calls: list[bool] = []

    async def reset_prefix_cache() -> bool:
        calls.append(observed_answer[0])
        return observed_answer[0]

    observed_answer = [True]
    monkeypatch.setattr(live[0], "reset_prefix_cache", reset_prefix_cache, raising=False)
    return calls, observed_answer


def test_needs_the_api_key(live, observed):
    calls, _ = observed
    with httpx.Client(base_url=live[1].url, timeout=30) as http:
        r = http.post("/reset_prefix_cache")
        assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
        assert calls == []
        r = http.post("/reset_prefix_cache", headers={"Authorization": f"Bearer {KEY}"})
    assert (r.status_code, r.content) == (200, b"")
    assert calls == [True]


def test_busy_cache_is_a_409_in_openai_format(live, observed):
    calls, answer = observed
    answer[0] = False
    with httpx.Client(base_url=live[1].url, timeout=30) as http:
        r = http.post("/reset_prefix_cache", headers={"Authorization": f"Bearer {KEY}"})
    assert r.status_code == 409
    assert r.json()["error"]["code"] == "prefix_cache_in_use"
    assert calls == [False]


def _metric(http: httpx.Client, name: str) -> float:
    text = http.get("/metrics").text
    return sum(float(v) for v in re.findall(rf"^vllm:{name}\{{[^}}]*\}} (\S+)$", text, re.M))


def test_real_engine_forgets_cached_prefixes(live):
    prompt = "The quick brown fox jumps over the lazy dog. " * 4  # several full KV blocks
    headers = {"Authorization": f"Bearer {KEY}"}
    with httpx.Client(base_url=live[1].url, timeout=60, headers=headers) as http:

        def complete_and_read_hits() -> float:
            """Prompt tokens found in the prefix cache by one more request with `prompt`."""
            hits, done = _metric(http, "prefix_cache_hits_total"), _metric(http, "request_success_total")
            assert http.post("/v1/completions", json={"prompt": prompt, "max_tokens": 1}).status_code == 200
            deadline = time.monotonic() + 10
            while _metric(http, "request_success_total") == done:  # its stats have reached /metrics
                assert time.monotonic() < deadline
                time.sleep(0.02)
            return _metric(http, "prefix_cache_hits_total") - hits

        complete_and_read_hits()  # fills the cache
        assert complete_and_read_hits() > 0  # the same prompt hits it
        r = http.post("/reset_prefix_cache")
        assert (r.status_code, r.content) == (200, b"")
        assert complete_and_read_hits() == 0  # forgotten
        assert complete_and_read_hits() > 0  # and filled again
