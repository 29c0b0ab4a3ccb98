"""A dead model worker is fatal, and only then: in-flight requests end with a clear error, /health
answers 503 within a second, and the `aserve` process exits non-zero (a supervisor restarts it)."""

from __future__ import annotations

import os
import signal
import subprocess
from pathlib import Path

import httpx
import pytest

from tests.server.real_tiny_server import build_tiny_chat_model
from tests.server.server_harness import start_server_process

pytestmark = pytest.mark.timeout(180)


def _children(pid: int) -> list[int]:
    kids = []
    for task in Path(f"/proc/{pid}/task").iterdir():
        text = (task / "children").read_text().split()
        kids += [int(k) for k in text]
    return kids


def _start(model: str) -> tuple[subprocess.Popen, str, list[str]]:
    return start_server_process([
        "-m", "aserve.server.cli", "--model", model, "--distributed-executor-backend", "mp", "--dtype",
        "float32", "--max-model-len", "256", "--cpu-kvcache-space", "0.02", "--host", "127.0.0.1", "--port",
        "0", "--disable-log-requests", "--disable-log-stats"])


@pytest.mark.skipif(not Path("/proc/self/task").is_dir(), reason="needs /proc to find the worker process")
def test_sigkill_of_the_worker_fails_requests_then_health_then_exits_non_zero(tmp_path):
    proc, url, log = _start(build_tiny_chat_model(tmp_path))
    try:
        workers = _children(proc.pid)
        assert workers, "the mp executor's worker process must exist"
        with httpx.Client(base_url=url, timeout=30) as client:
            assert client.get("/health").status_code == 200
            body = {"prompt": [5, 6, 7, 8], "max_tokens": 200, "ignore_eos": True, "stream": True}
            with client.stream("POST", "/v1/completions", json=body) as r:
                assert r.status_code == 200
                lines = r.iter_lines()
                first = next(line for line in lines if line.startswith("data: "))
                assert '"choices"' in first
                for pid in workers:
                    os.kill(pid, signal.SIGKILL)
                rest = [line for line in lines if line]
            assert any('"error"' in line for line in rest), rest
            # The server lingers ENGINE_DEATH_LINGER_S (2 s) answering 503 before it exits, so this
            # succeeds only if /health turned 503 right away.
            assert client.get("/health").status_code == 503
        assert proc.wait(timeout=30) != 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
