"""Sleep mode (`--enable-sleep-mode`: POST /sleep, POST /wake_up, GET /is_sleeping), /ping and /load on a
real tiny server (in-process, thread executor, so the runner's memory is this process's memory).

The KV cache is 256 MiB (`kv_cache_memory_bytes`); its pages are written once, as a long-running
server's would be, so that releasing it shows in this process's RSS.
"""

from __future__ import annotations

import os

import httpx
import pytest

from tests.server.real_tiny_server import build_tiny_chat_model, serving
from tests.server.server_harness import quiet_args

KEY = "sk-sleep"
AUTH = {"Authorization": f"Bearer {KEY}"}
KV_BYTES = 256 * 2**20
PROMPT = "The quick brown fox jumps over the lazy dog."
pytestmark = pytest.mark.timeout(300)


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return build_tiny_chat_model(tmp_path_factory.mktemp("tiny_chat"))


@pytest.fixture(scope="module")
def live(model):
    server = serving(model, quiet_args(api_key=KEY), enable_sleep_mode=True, num_gpu_blocks_override=None,
                     kv_cache_memory_bytes=KV_BYTES)
    with server as (engine, address), httpx.Client(base_url=address.url, timeout=60, headers=AUTH) as http:
        yield engine, http


def _runner(engine):
    return engine.engine.core._executor.runner  # the thread executor's runner (this process)


def _rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _greedy(http: httpx.Client) -> list[int] | str:
    r = http.post("/v1/completions", json={"prompt": PROMPT, "max_tokens": 12, "temperature": 0,
                                           "logprobs": 0})
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["text"]


def _assert_asleep(http: httpx.Client) -> None:
    assert http.get("/is_sleeping").json() == {"is_sleeping": True}
    for path, body in (("/v1/completions", {"prompt": PROMPT, "max_tokens": 2}),
                       ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2})):
        r = http.post(path, json=body)
        assert r.status_code == 503, r.text
        error = r.json()["error"]
        assert error["code"] == "model_sleeping" and "sleep mode" in error["message"]
        assert "/wake_up" in error["message"]
    assert http.post("/tokenize", json={"prompt": PROMPT}).status_code == 200  # needs no model


def test_level_1_releases_the_kv_cache_memory_and_wakes_with_the_same_output(live):
    engine, http = live
    before = _greedy(http)
    runner = _runner(engine)
    shapes = [tuple(t.shape) for t in runner.kv_caches]
    assert sum(t.numel() * t.element_size() for t in runner.kv_caches) >= KV_BYTES * 0.99
    for i in range(len(runner.kv_caches)):  # every page resident, as after a long run (no reference kept here)
        runner.kv_caches[i].fill_(1)
    rss_awake = _rss()
    assert http.post("/sleep", params={"level": 1}).status_code == 200
    released = rss_awake - _rss()
    assert released >= 0.9 * KV_BYTES, f"RSS dropped by {released / 2**20:.0f} MiB only"
    assert runner.kv_caches == [] and runner.model is not None  # level 1 keeps the weights
    assert all(layer.kv_cache is None for layer in runner.model.attention_layers)
    _assert_asleep(http)
    assert http.post("/wake_up").status_code == 200
    assert http.get("/is_sleeping").json() == {"is_sleeping": False}
    assert [tuple(t.shape) for t in runner.kv_caches] == shapes
    assert _greedy(http) == before


def test_level_2_drops_the_weights_and_reloads_them(live):
    engine, http = live
    before = _greedy(http)
    runner = _runner(engine)
    old_model = runner.model
    assert http.post("/sleep?level=2").status_code == 200
    assert runner.model is None and runner.kv_caches == []
    _assert_asleep(http)
    assert http.post("/wake_up").status_code == 200
    assert runner.model is not None and runner.model is not old_model  # reloaded from the checkpoint
    assert _greedy(http) == before


def test_tags_wake_only_those_parts(live):
    engine, http = live
    before = _greedy(http)
    runner = _runner(engine)
    assert http.post("/sleep?level=2").status_code == 200
    assert http.post("/wake_up?tags=weights").status_code == 200
    assert runner.model is not None and runner.kv_caches == []
    _assert_asleep(http)  # the KV cache is still asleep
    r = http.post("/wake_up?tags=bogus")
    assert r.status_code == 400 and r.json()["error"]["param"] == "tags"
    assert http.post("/wake_up?tags=kv_cache").status_code == 200
    assert http.get("/is_sleeping").json() == {"is_sleeping": False}
    assert _greedy(http) == before


def test_bad_level_is_a_400(live):
    _, http = live
    r = http.post("/sleep?level=3")
    assert r.status_code == 400 and r.json()["error"]["param"] == "level"
    assert http.get("/is_sleeping").json() == {"is_sleeping": False}


def test_sleep_mode_routes_need_the_api_key(live):
    _, http = live
    for method, path in (("POST", "/sleep"), ("POST", "/wake_up"), ("GET", "/is_sleeping")):
        r = http.request(method, path, headers={"Authorization": "Bearer wrong"})
        assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key", path
    assert http.get("/is_sleeping").json() == {"is_sleeping": False}


def test_sleep_is_refused_while_a_request_runs_and_load_counts_it(live):
    _, http = live
    body = {"prompt": PROMPT, "max_tokens": 100, "ignore_eos": True, "stream": True}
    with http.stream("POST", "/v1/completions", json=body) as stream:
        lines = stream.iter_lines()
        assert next(line for line in lines if line.startswith("data:"))  # it is running
        assert http.get("/load").json()["server_load"] >= 1
        r = http.post("/sleep")
        assert r.status_code == 409 and r.json()["error"]["code"] == "requests_running"
        for _ in lines:
            pass
    assert http.get("/is_sleeping").json() == {"is_sleeping": False}
    assert http.get("/load").json() == {"server_load": 0}


def test_without_the_flag_the_routes_are_404_naming_it_and_ping_load_answer(model):
    with serving(model, quiet_args()) as (_, address), httpx.Client(base_url=address.url, timeout=60) as http:
        for method, path in (("POST", "/sleep"), ("POST", "/wake_up"), ("GET", "/is_sleeping")):
            r = http.request(method, path)
            assert r.status_code == 404 and "--enable-sleep-mode" in r.json()["error"]["message"], path
        assert http.get("/ping").status_code == 200 and http.post("/ping").status_code == 200
        assert http.get("/load").json() == {"server_load": 0}
        assert http.post("/v1/completions", json={"prompt": PROMPT, "max_tokens": 2}).status_code == 200


def test_a_sleep_during_a_wake_up_leaves_the_engine_asleep_and_alive(live, monkeypatch):
    """POST /sleep while a /wake_up is still reloading: the sleep waits for it, then the engine sleeps
    (requests keep getting 503 throughout), and a later wake-up serves the same tokens."""
    import threading
    import time

    engine, http = live
    before = _greedy(http)
    core = engine.engine.core
    slow_wake = core.wake_up

    def wake_slowly(*args):
        time.sleep(1.0)
        return slow_wake(*args)

    assert http.post("/sleep", params={"level": 2}).status_code == 200
    monkeypatch.setattr(core, "wake_up", wake_slowly)
    waking = threading.Thread(target=lambda: http.post("/wake_up"))
    waking.start()
    time.sleep(0.3)  # the wake-up is reloading the weights
    assert http.post("/sleep", params={"level": 1}).status_code == 200
    waking.join()
    _assert_asleep(http)
    monkeypatch.setattr(core, "wake_up", slow_wake)
    assert http.post("/wake_up").status_code == 200
    assert http.get("/is_sleeping").json() == {"is_sleeping": False}
    assert _greedy(http) == before
