"""SIGTERM loses no accepted request: with streams running and more waiting for a batch slot, every
one of them completes in full, new connections are refused, and the process exits 0.

(SIGKILL of the `mp` worker goes through the fatal path instead: tests/server/test_engine_death.py.)
"""

from __future__ import annotations

import json
import re
import signal
import subprocess
import threading
import time

import httpx
import pytest

from tests.server.real_tiny_server import build_tiny_chat_model
from tests.server.server_harness import start_server_process

pytestmark = pytest.mark.timeout(240)


def _start(model: str) -> tuple[subprocess.Popen, str, list[str]]:
    return start_server_process([
        "-m", "aserve.server.cli", "--model", model, "--dtype", "float32", "--max-model-len", "128",
        "--max-num-seqs", "2", "--num-gpu-blocks-override", "64", "--host", "127.0.0.1", "--port", "0",
        "--disable-log-requests", "--disable-log-stats", "--shutdown-grace-period", "60"])


def _accepted(url: str) -> int:
    """Requests the engine holds (running or waiting) plus those it already finished."""
    text = httpx.get(f"{url}/metrics", timeout=10).text
    held = re.findall(r"^vllm:num_requests_(?:running|waiting)\{[^}]*\} (\S+)$", text, re.M)
    done = re.findall(r"^vllm:request_success_total\{[^}]*\} (\S+)$", text, re.M)
    return int(sum(float(v) for v in held + done))


def test_sigterm_completes_every_accepted_request(tmp_path):
    proc, url, log = _start(build_tiny_chat_model(tmp_path))
    num_streams, max_tokens = 6, 100  # long enough that most are still waiting at the SIGTERM
    results: dict[int, list[str]] = {}
    non_stream: dict = {}
    body = {"prompt": [5, 6, 7, 8], "max_tokens": max_tokens, "ignore_eos": True}

    def stream(i: int) -> None:
        with httpx.Client(base_url=url, timeout=120) as client:
            with client.stream("POST", "/v1/completions", json={**body, "stream": True}) as r:
                results[i] = [line for line in r.iter_lines() if line]

    def collect() -> None:
        with httpx.Client(base_url=url, timeout=120) as client:
            non_stream["response"] = client.post("/v1/completions", json=body)

    try:
        threads = [threading.Thread(target=stream, args=(i,)) for i in range(num_streams)]
        threads.append(threading.Thread(target=collect))
        for t in threads:
            t.start()
        deadline = time.monotonic() + 60
        while _accepted(url) < num_streams + 1:  # all accepted (2 running, most of the rest waiting)
            assert time.monotonic() < deadline, "requests were not all accepted"
            time.sleep(0.02)
        proc.send_signal(signal.SIGTERM)
        time.sleep(0.3)
        with pytest.raises(httpx.TransportError):  # the listening socket is closed
            httpx.post(f"{url}/v1/completions", json=body, timeout=5)
        for t in threads:
            t.join(120)
        assert sorted(results) == list(range(num_streams))
        for lines in results.values():
            assert lines[-1] == "data: [DONE]"
            chunks = [json.loads(line[len("data: "):]) for line in lines[:-1]]
            assert sum(len(c["choices"]) for c in chunks) == max_tokens
            assert chunks[-1]["choices"][0]["finish_reason"] == "length"
        response = non_stream["response"]
        assert response.status_code == 200
        assert response.json()["usage"]["completion_tokens"] == max_tokens
        assert proc.wait(60) == 0, "".join(log)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
