"""Overload protection against a real server on a tiny model whose runner is made slow on purpose
(a fixed sleep per step): admission caps answer 429 with Retry-After, an oversized body 413 before it
is read, --request-timeout aborts (504 before the first byte, an SSE error event after) and frees the
request's KV blocks, and several API keys share the batch fairly."""

from __future__ import annotations

import contextlib
import json
import threading
import time
from collections.abc import Iterator
from functools import partial
from typing import Any

import anyio
import anyio.from_thread
import httpx
import pytest
from tests.server.server_harness import quiet_args

from aserve.config import EngineArgs
from aserve.executor.thread import ThreadExecutor
from aserve.server.app import client_id_of
from aserve.server.launch import serve

pytestmark = pytest.mark.timeout(300)

STEP_S = 0.05  # every step of the wrapped runner sleeps this long
SLOW_FIRST = 17  # a prompt starting with this token id makes its first step take 3 s


class SlowRunner:
    """The real runner, slowed down deterministically."""

    def __init__(self, config):
        from aserve.runner.model_runner import ModelRunner

        self.inner = ModelRunner(config)

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def execute(self, so):
        slow_first = any(new.prompt_token_ids[0] == SLOW_FIRST for new in so.new_requests)
        time.sleep(3.0 if slow_first else STEP_S)
        return self.inner.execute(so)


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    from tests.server.real_tiny_server import build_tiny_chat_model

    return build_tiny_chat_model(tmp_path_factory.mktemp("overload"))


@contextlib.contextmanager
def slow_server(model: str, **server_kwargs: Any) -> Iterator[tuple[Any, Any, str]]:
    """(portal, engine, url) of a real server over SlowRunner; max_num_seqs 2."""

    def build():
        from aserve.engine.async_engine import AsyncEngine

        args = EngineArgs(model=model, dtype="float32", max_model_len=128, max_num_seqs=2,
                          num_gpu_blocks_override=64)
        return AsyncEngine.from_engine_args(args, executor_factory=lambda config: ThreadExecutor(config, SlowRunner))

    with anyio.from_thread.start_blocking_portal("asyncio", backend_options={"use_uvloop": True}) as portal:
        engine = portal.call(build)
        stop = portal.call(anyio.Event)
        args = quiet_args(host="127.0.0.1", port=0, **server_kwargs)
        future, address = portal.start_task(partial(serve, engine, args, stop=stop, handle_signals=False))
        try:
            yield portal, engine, address.url
        finally:
            portal.call(stop.set)
            future.result(timeout=60)


def _wait_until(check, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        assert time.monotonic() < deadline, "condition not reached"
        time.sleep(0.02)


def _hold(url: str, body: dict, started: list, headers: dict | None = None) -> threading.Thread:
    """A streaming request in a thread, held open until its stream ends."""

    def run():
        with httpx.Client(base_url=url, timeout=60, headers=headers) as client:
            with client.stream("POST", "/v1/completions", json={**body, "stream": True}) as r:
                started.append(r.status_code)
                for _ in r.iter_lines():
                    pass

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread


LONG = {"prompt": [5, 6, 7, 8], "max_tokens": 40, "ignore_eos": True}


def test_queue_caps_answer_429_with_retry_after_and_count_samples(model):
    with slow_server(model, max_num_queued_reqs=3, max_num_queued_tokens=100) as (portal, engine, url):
        statuses: list = []
        threads = [_hold(url, LONG, statuses) for _ in range(2)]
        _wait_until(lambda: portal.call(engine.queued_load)[0] == 2)
        with httpx.Client(base_url=url, timeout=60) as client:
            r = client.post("/v1/completions", json={**LONG, "n": 2})  # 2 + 2 samples > 3
            assert r.status_code == 429, r.text
            assert 1 <= int(r.headers["retry-after"]) <= 60
            err = r.json()["error"]
            assert err["code"] == "queue_full" and "--max-num-queued-reqs" in err["message"]
            # Token cap: 2 running (their prompts computed) + one waiting 90-token prompt = 90 queued.
            threads.append(_hold(url, {**LONG, "prompt": [9] * 90, "max_tokens": 30}, statuses))
            _wait_until(lambda: portal.call(engine.queued_load) == (3, 90))
            r = client.post("/v1/completions", json={**LONG, "prompt": [9] * 20})
            assert r.status_code == 429 and "--max-num-queued-reqs" in r.json()["error"]["message"]
            for t in threads:
                t.join(60)
            assert statuses == [200, 200, 200]
            assert portal.call(engine.queued_load) == (0, 0)
            r = client.post("/v1/completions", json={**LONG, "max_tokens": 2, "n": 3})
            assert r.status_code == 200, r.text  # the caps are free again
            metrics = client.get("/metrics").text
            assert 'reason="overloaded"' in metrics


def test_token_cap_and_concurrent_arrivals_never_overshoot(model):
    with slow_server(model, max_num_queued_tokens=100) as (portal, engine, url):
        statuses: list = []
        threads = [_hold(url, LONG, statuses) for _ in range(2)]
        _wait_until(lambda: portal.call(engine.queued_load)[0] == 2)
        with httpx.Client(base_url=url, timeout=60) as client:
            r = client.post("/v1/completions", json={**LONG, "prompt": [9] * 101})  # 0 queued + 101
            assert r.status_code == 429
            shorter_queue_wait = int(r.headers["retry-after"])
        threads.append(_hold(url, {**LONG, "prompt": [9] * 90, "max_tokens": 30}, statuses))
        _wait_until(lambda: portal.call(engine.queued_load) == (3, 90))
        with httpx.Client(base_url=url, timeout=60) as client:
            r = client.post("/v1/completions", json={**LONG, "prompt": [9] * 20})
            assert r.status_code == 429 and "--max-num-queued-tokens" in r.json()["error"]["message"]
            # Retry-After follows the queue: 90 more prompt tokens ahead, nothing finished yet.
            assert shorter_queue_wait < int(r.headers["retry-after"]) <= 60
            r = client.post("/v1/completions", json={**LONG, "prompt": [9] * 10, "max_tokens": 1})
            assert r.status_code == 200  # 90 + 10 fits exactly
        for t in threads:
            t.join(60)
    with slow_server(model, max_num_queued_reqs=4) as (portal, engine, url):
        statuses = []
        threads = [_hold(url, LONG, statuses) for _ in range(12)]  # 12 arrive at once
        for t in threads:
            t.join(60)
        assert sorted(statuses) == [200] * 4 + [429] * 8


def test_body_over_the_limit_is_413_before_it_is_read(model):
    with slow_server(model, max_request_body_bytes=4096) as (portal, engine, url):
        with httpx.Client(base_url=url, timeout=60) as client:
            small = {"prompt": "hello", "max_tokens": 2}
            assert client.post("/v1/completions", json=small).status_code == 200
            big = json.dumps({"prompt": "hello " * 2000, "max_tokens": 2}).encode()
            r = client.post("/v1/completions", content=big, headers={"content-type": "application/json"})
            assert r.status_code == 413
            assert r.json()["error"]["code"] == "request_too_large"

            def chunked():  # no Content-Length: counted as it streams in
                for _ in range(100):
                    yield b" " * 1024

            r = client.post("/v1/completions", content=chunked(), headers={"content-type": "application/json"})
            assert r.status_code == 413 and r.json()["error"]["code"] == "request_too_large"
            assert client.get("/health").status_code == 200


def test_request_timeout_aborts_frees_blocks_and_answers_504_or_an_sse_error(model):
    with slow_server(model, request_timeout=1.0) as (portal, engine, url):
        with httpx.Client(base_url=url, timeout=60) as client:
            start = time.monotonic()
            r = client.post("/v1/completions", json={**LONG, "max_tokens": 100})  # needs ~5 s
            assert r.status_code == 504, r.text
            assert r.json()["error"]["code"] == "timeout"
            assert time.monotonic() - start < 4
            # A stream that has started: its last events are an error (code "timeout") and [DONE].
            with client.stream("POST", "/v1/chat/completions", json={
                    "messages": [{"role": "user", "content": "hi"}], "max_tokens": 100, "ignore_eos": True,
                    "stream": True}) as s:
                assert s.status_code == 200
                lines = [line for line in s.iter_lines() if line]
            assert lines[-1] == "data: [DONE]"
            assert json.loads(lines[-2][len("data: "):])["error"]["code"] == "timeout"
            assert len(lines) > 3  # the role chunk, token chunks, then the error and [DONE]
            r = client.post("/v1/completions", json={**LONG, "max_tokens": 3})
            assert r.status_code == 200  # within the timeout
            # A stream whose first token comes after the deadline: nothing was sent, so a 504 too.
            r = client.post("/v1/completions", json={**LONG, "prompt": [SLOW_FIRST, 5], "stream": True})
            assert r.status_code == 504 and r.json()["error"]["code"] == "timeout"
            _wait_until(lambda: portal.call(engine.queued_load)[0] == 0, timeout=10)
            assert portal.call(engine.get_scheduler_stats).num_used_blocks == 0


def test_chat_stream_sends_its_role_chunk_with_the_first_token(model):
    """The role chunk waits for the first token (as vLLM's), so a chat stream timing out before its
    first token is a 504 too, and the first chunk arrives when the first token does."""
    slow_chat = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, "ignore_eos": True,
                 "stream": True, "chat_template": "/{{ messages[0]['content'] }}"}  # "/" is token SLOW_FIRST
    with slow_server(model, request_timeout=1.0) as (portal, engine, url):
        with httpx.Client(base_url=url, timeout=60) as client:
            r = client.post("/v1/chat/completions", json=slow_chat)
            assert r.status_code == 504 and r.json()["error"]["code"] == "timeout"
            _wait_until(lambda: portal.call(engine.queued_load)[0] == 0, timeout=10)
    with slow_server(model) as (_, _, url):
        with httpx.Client(base_url=url, timeout=60) as client:
            start = time.monotonic()
            with client.stream("POST", "/v1/chat/completions", json=slow_chat) as s:
                lines = s.iter_lines()
                first = next(line for line in lines if line)
                first_s = time.monotonic() - start
                rest = [line for line in lines if line]
    assert first_s > 2.5  # the first step takes 3 s: nothing came before it
    assert json.loads(first[len("data: "):])["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert "role" not in json.loads(rest[0][len("data: "):])["choices"][0]["delta"]  # then the tokens
    assert rest[-1] == "data: [DONE]"


def test_several_api_keys_share_the_batch_and_only_a_hash_reaches_the_engine(model):
    keys = ("key-a", "key-b")
    with slow_server(model, api_key=keys) as (portal, engine, url):
        flood = {"prompt": [5, 6, 7, 8], "max_tokens": 20, "ignore_eos": True}
        statuses: list = []
        done_a: list[float] = []

        def a_request():
            with httpx.Client(base_url=url, timeout=120, headers={"Authorization": "Bearer key-a"}) as c:
                statuses.append(c.post("/v1/completions", json=flood).status_code)
                done_a.append(time.monotonic())

        threads = [threading.Thread(target=a_request, daemon=True) for _ in range(16)]
        for t in threads:
            t.start()
        _wait_until(lambda: portal.call(engine.queued_load)[0] == 16)

        def client_ids():
            return {r.client_id for r in engine.engine.core.scheduler.requests.values()}

        assert portal.call(client_ids) == {client_id_of("key-a")}
        assert "key-a" not in portal.call(client_ids)
        with httpx.Client(base_url=url, timeout=120, headers={"Authorization": "Bearer key-b"}) as c:
            r = c.post("/v1/completions", json={**flood, "max_tokens": 2})
        b_done = time.monotonic()
        assert r.status_code == 200
        # FCFS would run key A's 16 requests (8 rounds of 2) first; fair sharing admits B's as soon as
        # one of A's two running requests finishes.
        assert sum(t < b_done for t in done_a) <= 4, (len(done_a), statuses)
        for t in threads:
            t.join(120)
        assert statuses == [200] * 16
        with httpx.Client(base_url=url, timeout=10, headers={"Authorization": "Bearer nope"}) as c:
            assert c.post("/v1/completions", json=flood).status_code == 401
