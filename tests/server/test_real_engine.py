"""The server end to end with the real AsyncEngine and the bundled SmolLM2-135M-Instruct (marked slow)."""

from __future__ import annotations

import json
import re
import signal
import subprocess
import sys
import time
from functools import partial

import anyio
import anyio.from_thread
import httpx
import openai
import pytest

from aserve.config import BUNDLED_MODEL_NAME, EngineArgs
from aserve.server.args import ServerArgs
from aserve.server.launch import serve
from tests.server.server_harness import quiet_args

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

MODEL = BUNDLED_MODEL_NAME
# fp32: on CPUs with native bf16, dtype=auto picks bf16, whose greedy tokens depend on the batch's company
# (a solo run and a 16-stream run then differ), which is not what these tests are about.
ENGINE_ARGS = dict(max_model_len=512, num_gpu_blocks_override=96, max_num_seqs=16, dtype="float32")


def _build_engine(executor: str):
    from aserve.engine.async_engine import AsyncEngine

    return AsyncEngine.from_engine_args(EngineArgs(**ENGINE_ARGS, distributed_executor_backend=executor))


@pytest.fixture(scope="module", params=["uni", "mp"])
def real(request):
    """A real server, once with the runner on a thread (uni) and once in a worker process (mp)."""
    with anyio.from_thread.start_blocking_portal("asyncio", backend_options={"use_uvloop": True}) as portal:
        engine = portal.call(_build_engine, request.param)  # built on the loop thread: it creates anyio primitives
        stop = portal.call(anyio.Event)
        args = ServerArgs(**{**vars(quiet_args()), "host": "127.0.0.1", "port": 0})
        future, address = portal.start_task(partial(serve, engine, args, stop=stop, handle_signals=False))
        try:
            yield engine, address
        finally:
            portal.call(stop.set)
            future.result(timeout=60)


@pytest.fixture(scope="module")
def client(real):
    with openai.OpenAI(base_url=f"{real[1].url}/v1", api_key="x", max_retries=0, timeout=120) as c:
        yield c


def wait_until(predicate, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "condition not reached in time"
        time.sleep(0.02)


def test_chat_stream_equals_non_stream(client):
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    full = client.chat.completions.create(model=MODEL, messages=messages, temperature=0, max_tokens=12)
    choice = full.choices[0]
    assert choice.message.content and choice.finish_reason in ("stop", "length")
    assert full.usage.total_tokens == full.usage.prompt_tokens + full.usage.completion_tokens
    chunks = list(
        client.chat.completions.create(
            model=MODEL,
            messages=messages,
            temperature=0,
            max_tokens=12,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == choice.message.content
    assert chunks[-1].usage.completion_tokens == full.usage.completion_tokens


def test_completions_echo_logprobs_and_n(client):
    resp = client.completions.create(
        model=MODEL, prompt="The capital of France is", max_tokens=4, temperature=0, logprobs=2, echo=True
    )
    lp = resp.choices[0].logprobs
    assert resp.choices[0].text.startswith("The capital of France is")
    assert lp.token_logprobs[0] is None and all(v is not None for v in lp.token_logprobs[1:])
    assert len(lp.tokens) == resp.usage.prompt_tokens + resp.usage.completion_tokens
    many = client.completions.create(
        model=MODEL, prompt=["One, two,", "Red, green,"], max_tokens=4, n=2, seed=3
    )
    assert [c.index for c in many.choices] == [0, 1, 2, 3]
    again = client.completions.create(
        model=MODEL, prompt=["One, two,", "Red, green,"], max_tokens=4, n=2, seed=3
    )
    assert [c.text for c in again.choices] == [c.text for c in many.choices]


@pytest.mark.anyio
async def test_concurrent_streams_complete_with_the_solo_text(real):
    _, address = real
    prompts = [f"Write a short sentence about the number {i}." for i in range(8)]
    async with openai.AsyncOpenAI(
        base_url=f"{address.url}/v1", api_key="x", max_retries=0, timeout=300
    ) as client:
        solo = {}
        for p in prompts[:3]:
            r = await client.completions.create(model=MODEL, prompt=p, max_tokens=8, temperature=0)
            solo[p] = r.choices[0].text

        async def stream(p: str, out: dict) -> None:
            s = await client.completions.create(
                model=MODEL,
                prompt=p,
                max_tokens=8,
                temperature=0,
                stream=True,
                stream_options={"include_usage": True},
            )
            text, finish, usage = "", None, None
            async for chunk in s:
                if chunk.choices:
                    text += chunk.choices[0].text
                    finish = chunk.choices[0].finish_reason or finish
                if chunk.usage:
                    usage = chunk.usage
            out[p] = (text, finish, usage)

        results: dict = {}
        async with anyio.create_task_group() as tg:
            for p in prompts:
                tg.start_soon(stream, p, results)
    assert len(results) == len(prompts)
    for _text, finish, usage in results.values():
        assert finish in ("stop", "length") and usage.completion_tokens >= 1
    for p, text in solo.items():
        assert results[p][0] == text


def test_disconnect_frees_kv_blocks(real):
    engine, address = real
    wait_until(lambda: engine.get_scheduler_stats().num_running_reqs == 0)
    with httpx.Client(base_url=address.url, timeout=60) as http:
        with http.stream(
            "POST",
            "/v1/completions",
            json={"prompt": "Tell me a long story.", "max_tokens": 400, "stream": True, "ignore_eos": True},
        ) as r:
            lines = r.iter_lines()
            assert next(lines).startswith("data: ")
            assert engine.get_scheduler_stats().num_used_blocks > 0
    # closing the stream aborted the request: its blocks are back within a step
    wait_until(
        lambda: (
            engine.get_scheduler_stats().num_running_reqs == 0
            and engine.get_scheduler_stats().num_used_blocks == 0
        )
    )


def test_metrics_move_with_real_engine(client, real):
    _, address = real
    with httpx.Client(base_url=address.url) as http:
        before = http.get("/metrics").text
        client.completions.create(
            model=MODEL, prompt="Hello", max_tokens=3, temperature=0, extra_body={"ignore_eos": True}
        )
        after = http.get("/metrics").text

    def value(text: str, name: str) -> float:
        return sum(float(m) for m in re.findall(rf"^{re.escape(name)}{{[^}}]*}} (\S+)$", text, re.M))

    assert value(after, "vllm:request_success_total") == value(before, "vllm:request_success_total") + 1
    assert (
        value(after, "vllm:generation_tokens_total") >= value(before, "vllm:generation_tokens_total") + 3
    )


def test_cli_serves_and_exits_0_on_sigterm(tmp_path):
    # A tiny chat model and a thread executor keep this quick; the server's default worker process
    # is exercised by test_drain.py and test_engine_death.py.
    from tests.server.real_tiny_server import TINY_MAX_MODEL_LEN, build_tiny_chat_model

    model = build_tiny_chat_model(tmp_path / "tiny")
    args = ["--host", "127.0.0.1", "--port", "0", "--disable-log-stats", "--disable-log-requests",
            "--distributed-executor-backend", "uni", "--model", model, "--dtype", "float32",
            "--max-model-len", str(TINY_MAX_MODEL_LEN), "--num-gpu-blocks-override", "64"]
    proc = subprocess.Popen(
        [sys.executable, "-m", "aserve.server.cli", *args],
        stderr=subprocess.PIPE,
        stdout=subprocess.DEVNULL,
        text=True,
    )
    try:
        url = None
        log = []
        assert proc.stderr is not None
        for line in proc.stderr:
            log.append(line)
            match = re.search(r"serving .* on (http://\S+)", line)
            if match:
                url = match.group(1)
                break
        assert url, "".join(log)
        with httpx.Client(base_url=url, timeout=120) as http:
            assert http.get("/health").status_code == 200
            r = http.post(
                "/v1/chat/completions",
                json={"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4, "stream": True},
            )
            assert r.text.endswith("data: [DONE]\n\n")
            assert (
                json.loads(r.text.split("\n\n")[0][len("data: ") :])["choices"][0]["delta"]["role"]
                == "assistant"
            )
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(60) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
