"""Early refusals reach the client (issue 29): a server process answers 413 / 401 / 429 / 404 before
reading a large body, then reads and discards the rest (`aserve/server/linger.py`), so the async and
sync `openai` SDKs and raw httpx clients (fresh and pooled connections) read the status, not a
connection error; the server stays healthy and does not keep what it discards."""

from __future__ import annotations

import json
import subprocess
import threading
from collections.abc import Iterator
from pathlib import Path

import anyio
import httpx
import openai
import pytest

from tests.server.server_harness import start_server_process

pytestmark = pytest.mark.timeout(300)

ROOT = Path(__file__).resolve().parents[2]
KEY = "sekret"
MB = 1024 * 1024
LIMIT = 32 * MB  # the default --max-request-body-bytes
SIZES = (40 * MB, 200 * MB)


@pytest.fixture(scope="module")
def server() -> Iterator[tuple[subprocess.Popen, str]]:
    args = {"api_key": KEY, "max_num_queued_reqs": 1}
    proc, url, log = start_server_process(
        ["-m", "tests.server.fake_server_main", "0.2", "1", json.dumps(args)], cwd=ROOT, timeout=60)
    try:
        yield proc, url
    finally:
        proc.kill()
        proc.wait()


def rss_bytes(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise AssertionError("no VmRSS")


def chat_body(num_bytes: int) -> bytes:
    """A chat request whose JSON is `num_bytes` long."""
    head = b'{"model": "m", "max_tokens": 2, "messages": [{"role": "user", "content": "'
    tail = b'"}]}'
    return head + b"a" * (num_bytes - len(head) - len(tail)) + tail


def sdk_messages(num_bytes: int) -> list[dict]:
    return [{"role": "user", "content": "a" * num_bytes}]


def expect_status_sync_sdk(url: str, status: int, num_bytes: int, key: str | None = KEY) -> None:
    client = openai.OpenAI(base_url=f"{url}/v1", api_key=key or "wrong", max_retries=0, timeout=120)
    with pytest.raises(openai.APIStatusError) as info:
        client.chat.completions.create(model="m", messages=sdk_messages(num_bytes), max_tokens=2)
    assert info.value.status_code == status
    client.close()


async def expect_status_async_sdk(url: str, status: int, num_bytes: int, key: str | None = KEY) -> None:
    client = openai.AsyncOpenAI(base_url=f"{url}/v1", api_key=key or "wrong", max_retries=0, timeout=120)
    with pytest.raises(openai.APIStatusError) as info:
        await client.chat.completions.create(model="m", messages=sdk_messages(num_bytes), max_tokens=2)
    assert info.value.status_code == status
    await client.close()


async def expect_status_httpx(client: httpx.AsyncClient, status: int, body: bytes, key: str | None = KEY,
                              path: str = "/v1/chat/completions") -> None:
    headers = {"content-type": "application/json"}
    if key:
        headers["authorization"] = f"Bearer {key}"
    r = await client.post(path, content=body, headers=headers)
    assert r.status_code == status, r.text
    assert "error" in r.json()


def all_clients(url: str, status: int, num_bytes: int, key: str | None = KEY) -> None:
    """The four clients each get `status` for a body of `num_bytes`."""
    expect_status_sync_sdk(url, status, num_bytes, key)
    body = chat_body(num_bytes)

    async def async_clients() -> None:
        await expect_status_async_sdk(url, status, num_bytes, key)
        async with httpx.AsyncClient(base_url=url, timeout=120) as fresh:
            await expect_status_httpx(fresh, status, body, key)
        async with httpx.AsyncClient(base_url=url, timeout=120) as pooled:  # one connection, reused
            for _ in range(2):
                await expect_status_httpx(pooled, status, body, key)
            r = await pooled.get("/health")
            assert r.status_code == 200

    anyio.run(async_clients)


def test_413_reaches_every_client_and_the_server_keeps_nothing(server):
    proc, url = server
    all_clients(url, 413, SIZES[0])  # warm-up: the first requests load the clients' code paths
    before = rss_bytes(proc.pid)
    for size in SIZES:
        all_clients(url, 413, size)
    assert rss_bytes(proc.pid) - before < 48 * MB  # ~1.3 GB were sent and discarded
    assert httpx.get(f"{url}/health").status_code == 200


def test_413_for_a_body_without_content_length():
    async def run(url: str) -> None:
        async def chunks():  # counted as it streams in; the rest is discarded after the answer
            for _ in range(64):
                yield b" " * MB

        async with httpx.AsyncClient(base_url=url, timeout=120) as client:
            headers = {"content-type": "application/json", "authorization": f"Bearer {KEY}"}
            r = await client.post("/v1/chat/completions", content=chunks(), headers=headers)
            assert r.status_code == 413 and r.json()["error"]["code"] == "request_too_large"

    proc, url, _ = start_server_process(
        ["-m", "tests.server.fake_server_main", "0", "1", json.dumps({"api_key": KEY})], cwd=ROOT, timeout=60)
    try:
        anyio.run(run, url)
    finally:
        proc.kill()
        proc.wait()


def test_401_and_404_on_large_bodies_reach_every_client(server):
    proc, url = server
    all_clients(url, 401, 20 * MB, key=None)

    async def unknown_route() -> None:
        async with httpx.AsyncClient(base_url=url, timeout=120) as client:
            await expect_status_httpx(client, 404, chat_body(20 * MB), path="/v1/no_such_route")

    anyio.run(unknown_route)


def test_429_on_a_large_body_reaches_every_client(server):
    proc, url = server
    started = threading.Event()
    stop = threading.Event()

    def hold_the_queue() -> None:  # one slow request fills --max-num-queued-reqs 1
        headers = {"authorization": f"Bearer {KEY}"}
        body = {"prompt": "hello", "max_tokens": 200, "stream": True}
        with httpx.Client(base_url=url, timeout=120, headers=headers) as client:
            with client.stream("POST", "/v1/completions", json=body) as r:
                for _ in r.iter_lines():
                    started.set()
                    if stop.is_set():
                        break

    holder = threading.Thread(target=hold_the_queue, daemon=True)
    holder.start()
    try:
        assert started.wait(30)
        all_clients(url, 429, 20 * MB)
        r = httpx.post(f"{url}/v1/chat/completions", content=chat_body(MB),
                       headers={"authorization": f"Bearer {KEY}", "content-type": "application/json"})
        assert r.status_code == 429 and 1 <= int(r.headers["retry-after"]) <= 60
    finally:
        stop.set()
        holder.join(60)
    assert httpx.get(f"{url}/health").status_code == 200
