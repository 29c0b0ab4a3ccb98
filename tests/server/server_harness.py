"""Run the real server (`aserve.server.launch.serve`: hypercorn + engine loop in one anyio task group,
on uvloop) in a blocking portal's event-loop thread, so sync and async clients can talk to it over
real HTTP on 127.0.0.1. The engine is the real AsyncEngine over a fake model (tests/support/fake_model.py)."""

from __future__ import annotations

import contextlib
import json
import re
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from functools import partial
from typing import Any

import anyio
import anyio.from_thread
import httpx

from aserve.engine.async_engine import AsyncEngine, RequestStream
from aserve.engine.llm_engine import LLMEngine
from aserve.sampling_params import SamplingParams
from aserve.server.args import ServerArgs
from aserve.server.launch import BoundAddress, serve
from tests.support.fake_model import FakeModel, engine_args, fake_executor_factory

MODEL = "fake-model"
CHATML_USER = "<|im_start|>user\n{}<|im_end|>\n<|im_start|>assistant\n"  # a user turn, ChatML
CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"
USER = [{"role": "user", "content": "hello"}]


@dataclass
class AddedRequest:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    priority: int


class RecordingAsyncEngine(AsyncEngine):
    """The real AsyncEngine, also recording what reached it (so tests can check what the server asked
    for: the rendered prompt, the sampling parameters, which requests it aborted)."""

    def __init__(self, engine: LLMEngine):
        super().__init__(engine)
        self.added: list[AddedRequest] = []
        self.aborted: list[str] = []

    def add_request(self, request_id: str, prompt: str | None, prompt_token_ids: list[int] | None,
                    params: SamplingParams, priority: int = 0, client_id: str | None = None,
                    lora_request=None) -> RequestStream:
        stream = super().add_request(request_id, prompt, prompt_token_ids, params, priority, client_id, lora_request)
        self.added.append(AddedRequest(request_id, list(stream.prompt_token_ids), params, priority))
        return stream

    async def abort(self, request_id: str) -> None:
        self.aborted.append(request_id)
        await super().abort(request_id)


def recording_engine(folder: str, model: FakeModel, **overrides: Any) -> RecordingAsyncEngine:
    """The real engine over `model`, serving the name "fake-model" unless told otherwise. Build it on the
    event loop's thread (it creates anyio primitives)."""
    overrides.setdefault("served_model_name", "fake-model")
    factory = fake_executor_factory(model)
    return RecordingAsyncEngine(LLMEngine.from_engine_args(engine_args(folder, **overrides),
                                                           executor_factory=factory))


def last_added(engine: RecordingAsyncEngine) -> tuple[list[int], SamplingParams]:
    """The prompt token ids and sampling parameters of the last request the server handed the engine."""
    added = engine.added[-1]
    return added.prompt_token_ids, added.params


def expected_text(model: FakeModel, tokenizer: Any, prompt_ids: list[int], params: SamplingParams,
                  index: int = 0) -> str:
    """What sample `index` says (before stop strings): the fake model's tokens, decoded."""
    return tokenizer.decode(model.expected_token_ids(prompt_ids, params, index))


def quiet_args(**kwargs: Any) -> ServerArgs:
    """ServerArgs for tests: no request or stats log lines, a short grace period."""
    base = {"disable_log_requests": True, "disable_log_stats": True, "shutdown_grace_period": 5.0}
    return ServerArgs(**{**base, **kwargs})


@dataclass
class RunningServer:
    engine: RecordingAsyncEngine
    address: BoundAddress
    portal: anyio.from_thread.BlockingPortal
    stop: anyio.Event
    future: Any  # concurrent.futures.Future of `serve`

    @property
    def url(self) -> str:
        return self.address.url

    def request_stop(self) -> None:
        self.portal.call(self.stop.set)


@contextlib.contextmanager
def running_server(make_engine: Callable[[], Any], args: ServerArgs | None = None,
                   join: bool = True) -> Iterator[RunningServer]:
    """Serve `make_engine()` (called on the loop thread) on 127.0.0.1, a free port, in a portal thread;
    on exit stops it gracefully and (with `join`) waits for `serve` to return."""
    args = ServerArgs(**{**vars(args or quiet_args()), "host": "127.0.0.1", "port": 0})
    with anyio.from_thread.start_blocking_portal("asyncio", backend_options={"use_uvloop": True}) as portal:
        engine = portal.call(make_engine)
        stop = portal.call(anyio.Event)
        future, address = portal.start_task(partial(serve, engine, args, stop=stop, handle_signals=False))
        server = RunningServer(engine, address, portal, stop, future)
        try:
            yield server
        finally:
            portal.call(stop.set)
            if join:
                future.result(timeout=60)
            else:
                with contextlib.suppress(BaseException):
                    future.result(timeout=60)


def wait_until(predicate: Callable[[], bool], timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "condition not reached in time"
        time.sleep(0.01)


def parse_sse(raw: bytes) -> list[str]:
    """Split an SSE body into its data payloads, checking the framing on the way."""
    assert raw.endswith(b"\n\n")
    events = raw.decode().split("\n\n")[:-1]
    payloads = []
    for e in events:
        assert e.startswith("data: ") and "\n" not in e, e
        payloads.append(e[len("data: ") :])
    return payloads


def error_body(r: httpx.Response, status: int, param: str | None = None) -> dict:
    """Checks `r` is an OpenAI-format error with `status` (and `param`); returns its `error` object."""
    assert r.status_code == status, r.text
    body = r.json()
    assert set(body) == {"error"}
    err = body["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert err["message"]
    if param is not None:
        assert err["param"] == param, err
    return err


def start_server_process(args: list[str], cwd: str | None = None,
                         timeout: float = 120) -> tuple[subprocess.Popen, str, list[str]]:
    """Runs `python <args>` (a server entry point), waits for its "serving ... on URL" log line and
    returns (process, URL, its stderr lines so far, still growing in a reader thread)."""
    proc = subprocess.Popen([sys.executable, *args], cwd=cwd, stderr=subprocess.PIPE,
                            stdout=subprocess.DEVNULL, text=True)
    log: list[str] = []
    deadline = time.monotonic() + timeout
    assert proc.stderr is not None
    while time.monotonic() < deadline:
        line = proc.stderr.readline()
        if not line:
            break
        log.append(line)
        match = re.search(r"serving .* on (https?://\S+)", line)
        if match:
            threading.Thread(target=lambda: log.extend(proc.stderr), daemon=True).start()
            return proc, match.group(1), log
    proc.kill()
    raise AssertionError("server did not start:\n" + "".join(log))


def concurrent_completion_tokens(url: str, model: str, prompts: list[list[int]], max_tokens: int,
                                 stream_every_other: bool = False) -> tuple[list[list[int]], str]:
    """Greedy `/v1/completions` of every token-id prompt at once (every other one streamed, with
    `stream_every_other`): (each prompt's token ids, read from `logprobs`; the /metrics text after,
    once /health answered 200)."""
    got: dict[int, list[int]] = {}

    async def main() -> str:
        async with httpx.AsyncClient(base_url=url, timeout=60) as client:
            async def one(i: int) -> None:
                body = {"model": model, "prompt": prompts[i], "max_tokens": max_tokens, "temperature": 0,
                        "ignore_eos": True, "logprobs": 0, "stream": stream_every_other and i % 2 == 1}
                if not body["stream"]:
                    r = await client.post("/v1/completions", json=body)
                    assert r.status_code == 200, r.text
                    tokens = r.json()["choices"][0]["logprobs"]["tokens"]
                else:
                    tokens = []
                    async with client.stream("POST", "/v1/completions", json=body) as r:
                        assert r.status_code == 200
                        async for line in r.aiter_lines():
                            if line.startswith("data: ") and line != "data: [DONE]":
                                tokens += json.loads(line[6:])["choices"][0]["logprobs"]["tokens"]
                got[i] = [int(t.split(":")[1]) for t in tokens]

            async with anyio.create_task_group() as tg:
                for i in range(len(prompts)):
                    tg.start_soon(one, i)
            assert (await client.get("/health")).status_code == 200
            return (await client.get("/metrics")).text

    metrics = anyio.run(main)
    return [got[i] for i in range(len(prompts))], metrics
