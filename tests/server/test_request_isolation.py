"""A failure that belongs to one request fails only that request: the runner reports it in
`RunnerOutput.failed_requests`, the client gets a 400 (or an SSE error event once streaming), and a
request running beside it gets exactly the text it gets alone; the server stays healthy."""

from __future__ import annotations

import json
from functools import partial

import anyio
import anyio.from_thread
import httpx
import pytest
from tests.server.server_harness import quiet_args

from aserve.config import EngineArgs
from aserve.core.batch import RunnerOutput
from aserve.executor.thread import ThreadExecutor
from aserve.server.args import ServerArgs
from aserve.server.launch import serve

pytestmark = pytest.mark.timeout(300)

POISON = 13  # a prompt starting with this token id fails in the (wrapped) runner


class FailOnePoisonedRequest:
    """The real runner, except that a request whose prompt starts with POISON fails alone when it
    would first sample (as a raising logits processor would)."""

    def __init__(self, config):
        from aserve.runner.model_runner import ModelRunner

        self.inner = ModelRunner(config)
        self.poisoned: set[str] = set()

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def execute(self, so):
        for new in so.new_requests:
            if new.prompt_token_ids[0] == POISON:
                self.poisoned.add(new.req_id)
        out = self.inner.execute(so)
        failed = {r: "its logits processor raised ValueError('boom')" for r in out.req_ids if r in self.poisoned}
        if not failed:
            return out
        keep = [i for i, r in enumerate(out.req_ids) if r not in failed]
        return RunnerOutput(req_ids=[out.req_ids[i] for i in keep],
                            sampled_token_ids=[out.sampled_token_ids[i] for i in keep],
                            logprobs=[out.logprobs[i] for i in keep] if out.logprobs else [],
                            prompt_logprobs=out.prompt_logprobs, failed_requests=failed)


@pytest.fixture(scope="module")
def url(tmp_path_factory):
    from tests.server.real_tiny_server import build_tiny_chat_model

    model = build_tiny_chat_model(tmp_path_factory.mktemp("isolation"))

    def build():
        from aserve.engine.async_engine import AsyncEngine

        args = EngineArgs(model=model, dtype="float32", max_model_len=128, cpu_kvcache_space=0.02)
        return AsyncEngine.from_engine_args(
            args, executor_factory=lambda config: ThreadExecutor(config, FailOnePoisonedRequest))

    with anyio.from_thread.start_blocking_portal("asyncio", backend_options={"use_uvloop": True}) as portal:
        engine = portal.call(build)
        stop = portal.call(anyio.Event)
        args = ServerArgs(**{**vars(quiet_args()), "host": "127.0.0.1", "port": 0})
        future, address = portal.start_task(partial(serve, engine, args, stop=stop, handle_signals=False))
        try:
            yield address.url
        finally:
            portal.call(stop.set)
            future.result(timeout=60)


HEALTHY = {"prompt": [5, 6, 7, 8], "max_tokens": 24, "temperature": 0, "ignore_eos": True}
POISONED = {"prompt": [POISON, 6, 7], "max_tokens": 24, "temperature": 0, "ignore_eos": True}


def test_the_failing_request_gets_a_400_and_its_neighbour_its_solo_text(url):
    with httpx.Client(base_url=url, timeout=60) as http:
        solo = http.post("/v1/completions", json=HEALTHY).json()["choices"][0]["text"]
        results: dict = {}

        async def both():
            async with httpx.AsyncClient(base_url=url, timeout=60) as client:
                async def post(name, body):
                    results[name] = await client.post("/v1/completions", json=body)

                async with anyio.create_task_group() as tg:
                    tg.start_soon(post, "healthy", HEALTHY)
                    tg.start_soon(post, "poisoned", POISONED)

        anyio.run(both)
        bad = results["poisoned"]
        assert bad.status_code == 400, bad.text
        assert "logits processor raised" in bad.json()["error"]["message"]
        assert results["healthy"].status_code == 200
        assert results["healthy"].json()["choices"][0]["text"] == solo
        assert http.get("/health").status_code == 200
        assert http.post("/v1/completions", json=HEALTHY).json()["choices"][0]["text"] == solo


def test_a_streaming_request_that_fails_ends_with_an_error_event(url):
    with httpx.Client(base_url=url, timeout=60) as http:
        r = http.post("/v1/completions", json={**POISONED, "stream": True})
        assert r.status_code == 200
        events = [line[len("data: "):] for line in r.text.splitlines() if line.startswith("data: ")]
        assert events[-1] == "[DONE]"
        error = json.loads(events[-2])["error"]
        assert error["code"] == "invalid_request" and "logits processor raised" in error["message"]
        assert http.get("/health").status_code == 200
