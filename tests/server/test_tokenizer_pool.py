"""`--tokenizer-pool-size`: tokenizing runs on N threads, each with its own tokenizer copy (never two
threads on one), the same ids as one worker, through a live server; bad pool flags fail at start-up."""

from __future__ import annotations

import threading
import time
from concurrent.futures import ThreadPoolExecutor

import anyio
import httpx
import pytest

from aserve.config import ConfigError, EngineArgs
from aserve.server.tokenizer_pool import TokenizerPool
from tests.server.real_tiny_server import build_tiny_chat_model, serving
from tests.server.server_harness import quiet_args

pytestmark = pytest.mark.timeout(300)


class SlowTokenizer:
    """Records how many calls overlap, and fails if one copy is used by two threads at once."""

    def __init__(self, log: dict):
        self.log = log
        self.busy = False

    def __deepcopy__(self, memo):
        return SlowTokenizer(self.log)

    def encode(self, text):
        assert not self.busy, "one tokenizer used by two threads"
        self.busy = True
        with self.log["lock"]:
            self.log["now"] += 1
            self.log["peak"] = max(self.log["peak"], self.log["now"])
            self.log["copies"].add(id(self))
        time.sleep(0.05)
        with self.log["lock"]:
            self.log["now"] -= 1
        self.busy = False
        return [len(text)]


def _peak(size: int, calls: int = 8) -> tuple[int, int]:
    log = {"lock": threading.Lock(), "now": 0, "peak": 0, "copies": set()}
    pool = TokenizerPool(SlowTokenizer(log), lambda tok: None, size)

    async def main():
        async with anyio.create_task_group() as tg:
            for i in range(calls):
                tg.start_soon(pool.run, lambda w, i=i: w.tokenizer.encode("x" * i))

    anyio.run(main)
    return log["peak"], len(log["copies"])


@pytest.mark.parametrize("size, peak, copies", [(0, 1, 1), (1, 1, 1), (3, 3, 3)])
def test_pool_runs_size_workers_at_once_each_on_its_own_tokenizer(size, peak, copies):
    assert _peak(size) == (peak, copies)


def test_a_live_server_with_a_pool_tokenizes_as_one_worker_does(tmp_path):
    model = build_tiny_chat_model(tmp_path / "tiny")
    texts = [f"prompt number {i}: " + "the quick brown fox jumps over the lazy dog " * (20 + i) for i in range(12)]
    results = {}
    for size in (0, 3):
        with serving(model, quiet_args(), tokenizer_pool_size=size) as (_, address):
            with httpx.Client(base_url=address.url, timeout=60) as client, ThreadPoolExecutor(6) as ex:
                name = client.get("/v1/models").json()["data"][0]["id"]
                tokenized = list(ex.map(lambda t: client.post("/tokenize", json={"model": name, "prompt": t}), texts))
                chats = list(ex.map(lambda t: client.post("/v1/chat/completions", json={
                    "model": name, "messages": [{"role": "user", "content": t[:60]}], "max_tokens": 2,
                    "temperature": 0}), texts[:4]))
        assert all(r.status_code == 200 for r in tokenized + chats)
        results[size] = ([r.json()["tokens"] for r in tokenized], [r.json()["usage"]["prompt_tokens"] for r in chats])
    assert results[0] == results[3]


@pytest.mark.parametrize("kwargs, flag", [(dict(tokenizer_pool_type="ray"), "--tokenizer-pool-type"),
                                          (dict(tokenizer_pool_size=-1), "--tokenizer-pool-size"),
                                          (dict(tokenizer_pool_extra_config={"a": 1}), "--tokenizer-pool-extra-config")])
def test_bad_pool_flags_fail_at_start_up(kwargs, flag):
    with pytest.raises(ConfigError, match=flag):
        EngineArgs(model="x", **kwargs).validate()
