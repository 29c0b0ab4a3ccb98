"""SIGTERM / SIGINT on a server process: in-flight requests complete, new ones are refused, exit 0."""

from __future__ import annotations

import json
import signal
import subprocess
import threading
import time
from pathlib import Path

import httpx
import pytest

from tests.server.server_harness import start_server_process

pytestmark = pytest.mark.timeout(90)

ROOT = Path(__file__).resolve().parents[2]


def start_server(step_delay: float, grace: float) -> tuple[subprocess.Popen, str, list[str]]:
    """`tests/server/fake_server_main.py`: the real launch path and engine over a fake model."""
    return start_server_process(["-m", "tests.server.fake_server_main", str(step_delay), str(grace)],
                                cwd=ROOT, timeout=60)


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT])
def test_signal_drains_in_flight_refuses_new_and_exits_0(signum):
    proc, url, log = start_server(step_delay=0.05, grace=20)
    try:
        result: dict = {}
        first_chunk = threading.Event()

        def in_flight():
            with httpx.Client(base_url=url, timeout=30) as client:
                body = {"prompt": "hello", "max_tokens": 30, "stream": True,
                        "stream_options": {"include_usage": True}}
                with client.stream("POST", "/v1/completions", json=body) as r:
                    lines = []
                    for line in r.iter_lines():
                        if line:
                            lines.append(line)
                            first_chunk.set()
                    result["lines"] = lines

        thread = threading.Thread(target=in_flight)
        thread.start()
        assert first_chunk.wait(20)
        proc.send_signal(signum)
        time.sleep(0.3)
        with pytest.raises(httpx.TransportError):  # connection refused: the socket is closed
            httpx.post(f"{url}/v1/completions", json={"prompt": "late", "max_tokens": 2}, timeout=5)
        thread.join(30)
        lines = result["lines"]
        assert lines[-1] == "data: [DONE]"
        chunks = [json.loads(line[len("data: ") :]) for line in lines[:-1]]
        # a lagging reader gets merged deltas, so count tokens, not chunks
        assert chunks[-1]["usage"]["completion_tokens"] == 30
        assert [c["choices"][0]["finish_reason"] for c in chunks if c["choices"]][-1] == "length"
        assert "".join(c["choices"][0]["text"] for c in chunks if c["choices"]).count(" ") == 30
        assert proc.wait(30) == 0, "".join(log)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_grace_period_cuts_off_long_requests():
    proc, url, log = start_server(step_delay=0.05, grace=0.5)
    try:
        got_first = threading.Event()
        result: dict = {}

        def in_flight():
            try:
                with httpx.Client(base_url=url, timeout=30) as client:
                    with client.stream(
                        "POST",
                        "/v1/completions",
                        json={"prompt": "hello", "max_tokens": 1000, "stream": True},
                    ) as r:
                        for _line in r.iter_lines():
                            got_first.set()
                result["ended"] = "closed"
            except httpx.TransportError:
                result["ended"] = "error"

        thread = threading.Thread(target=in_flight)
        thread.start()
        assert got_first.wait(20)
        start = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(20) == 0, "".join(log)
        assert time.monotonic() - start < 10
        thread.join(10)
        assert result["ended"] in ("closed", "error")
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
