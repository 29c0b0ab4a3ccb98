"""A request's life against a real server (the real engine over a fake model): client disconnects
abort it and free its KV blocks, a request the model fails ends alone, draining finishes in-flight
requests and refuses new ones, engine death ends every stream and fails /health."""

from __future__ import annotations

import json
import threading
import time

import httpx
import pytest

from aserve.sampling_params import SamplingParams
from aserve.server.launch import EngineDiedError
from tests.server.server_harness import (
    CHAT,
    COMPLETIONS,
    USER,
    error_body,
    parse_sse,
    quiet_args,
    recording_engine,
    running_server,
    wait_until,
)
from tests.support.fake_model import FakeModel

pytestmark = pytest.mark.timeout(60)


# -- disconnects ------------------------------------------------------------------------------------


def test_stream_disconnect_aborts_and_frees_blocks(server, engine, fake_model):
    fake_model.step_delay = 0.02
    try:
        with httpx.Client(base_url=server.url, timeout=10) as client:
            with client.stream("POST", CHAT, json={"messages": USER, "max_tokens": 200, "stream": True}) as r:
                lines = r.iter_lines()
                assert next(lines).startswith("data: ")
                request_id = engine.added[-1].request_id
                wait_until(lambda: engine.get_scheduler_stats().num_used_blocks > 0)
            # leaving the block closes the connection mid-stream
        wait_until(lambda: request_id in engine.aborted)
        wait_until(lambda: engine.get_scheduler_stats().num_used_blocks == 0)
        assert request_id not in engine.streams
    finally:
        fake_model.step_delay = 0.0


def test_non_stream_disconnect_aborts(server, engine, fake_model):
    fake_model.pause()
    try:
        with httpx.Client(base_url=server.url, timeout=0.5) as client:
            with pytest.raises(httpx.ReadTimeout):
                client.post(COMPLETIONS, json={"prompt": "wait for me", "max_tokens": 50})
        request_id = engine.added[-1].request_id
        wait_until(lambda: request_id in engine.aborted)
        stats = engine.get_scheduler_stats()
        assert stats.num_running_reqs == 0 and stats.num_waiting_reqs == 0 and stats.num_used_blocks == 0
    finally:
        fake_model.resume()


# -- a request the model fails alone ----------------------------------------------------------------


@pytest.fixture
def poisoned(fake_model, tokenizer):
    """Prompts equal to "omega omega omega" fail in the runner (RunnerOutput.failed_requests)."""
    poison = tokenizer.encode("omega omega omega")
    fake_model.fail_if = lambda req_id, prompt: "logits processor raised" if prompt == poison else None
    yield "omega omega omega"
    fake_model.fail_if = None


def test_a_request_failed_by_the_model_ends_alone(server, fake_model, tokenizer, poisoned):
    fake_model.step_delay = 0.01
    try:
        with httpx.Client(base_url=server.url, timeout=20) as client:
            body = {"prompt": "red green", "max_tokens": 8, "temperature": 0, "stream": True}
            with client.stream("POST", COMPLETIONS, json=body) as healthy:
                lines = healthy.iter_lines()
                first = next(lines)
                bad = client.post(COMPLETIONS, json={"prompt": poisoned, "max_tokens": 3})
                rest = [first] + [line for line in lines if line]
    finally:
        fake_model.step_delay = 0.0
    assert bad.status_code != 200 or bad.json()["choices"][0]["finish_reason"] == "error"
    assert rest[-1] == "data: [DONE]"
    chunks = [json.loads(line[len("data: ") :]) for line in rest[:-1]]
    params = SamplingParams(temperature=0, max_tokens=8)
    expected = fake_model.expected_token_ids(tokenizer.encode("red green"), params)
    assert "".join(c["choices"][0]["text"] for c in chunks) == tokenizer.decode(expected)
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"


def test_a_request_failed_by_the_model_is_an_error_response(http, poisoned):
    error_body(http.post(COMPLETIONS, json={"prompt": poisoned, "max_tokens": 3}), 400)
    r = http.post(COMPLETIONS, json={"prompt": poisoned, "max_tokens": 3, "stream": True})
    payloads = parse_sse(r.content)
    assert payloads[-1] == "[DONE]" and "error" in json.loads(payloads[-2])


# -- shutdown and engine death ----------------------------------------------------------------------


def test_draining_refuses_new_requests_and_finishes_in_flight(model_folder, fake_model):
    fake_model.pause()
    result: dict = {}
    try:
        args = quiet_args(shutdown_grace_period=10)
        with running_server(lambda: recording_engine(model_folder, fake_model), args) as srv:
            keepalive = httpx.Client(base_url=srv.url, timeout=10)
            assert keepalive.get("/health").status_code == 200  # an open keep-alive connection

            def in_flight():
                with httpx.Client(base_url=srv.url, timeout=10) as c:
                    result["response"] = c.post(COMPLETIONS, json={"prompt": "slow", "max_tokens": 5})

            thread = threading.Thread(target=in_flight)
            thread.start()
            wait_until(lambda: len(srv.engine.streams) == 1)
            srv.request_stop()
            time.sleep(0.2)
            with pytest.raises(httpx.ConnectError):
                httpx.get(f"{srv.url}/health", timeout=2)
            try:
                refused = keepalive.get("/health")
                assert refused.status_code == 503
            except httpx.TransportError:
                pass  # the server closed the idle keep-alive connection: refused as well
            fake_model.resume()
            thread.join(10)
            srv.future.result(timeout=10)
            keepalive.close()
    finally:
        fake_model.resume()
    response = result["response"]
    assert response.status_code == 200
    assert response.json()["choices"][0]["finish_reason"] == "length"


def test_engine_death_ends_streams_fails_health_and_serve(model_folder, tokenizer):
    model = FakeModel.for_folder(model_folder)
    model.pause()
    with running_server(lambda: recording_engine(model_folder, model), quiet_args(), join=False) as srv:
        with httpx.Client(base_url=srv.url, timeout=10) as client:
            assert client.get("/health").status_code == 200
            rest: list[str] = []

            def stream() -> None:  # nothing is sent before the first token, so it waits in a thread
                with httpx.Client(base_url=srv.url, timeout=10) as c:
                    with c.stream("POST", CHAT, json={"messages": USER, "max_tokens": 5, "stream": True}) as r:
                        rest.extend(line for line in r.iter_lines() if line)

            thread = threading.Thread(target=stream)
            thread.start()
            wait_until(lambda: len(srv.engine.streams) == 1)  # in flight, its first step held
            model.fatal = RuntimeError("boom")  # the runner raises: fatal for the engine
            model.resume()
            thread.join(10)
            assert json.loads(rest[-2][len("data: ") :])["error"]["code"] == "engine_error"
            assert rest[-1] == "data: [DONE]"
            # the server lingers (ENGINE_DEATH_LINGER_S) answering 503 before it stops
            err = error_body(client.get("/health"), 503)
            assert err["type"] == "service_unavailable"
            assert error_body(client.post(CHAT, json={"messages": USER}), 503)["code"] == "engine_dead"
        with pytest.raises(EngineDiedError) as info:
            srv.future.result(timeout=10)
        assert "boom" in str(info.value)


