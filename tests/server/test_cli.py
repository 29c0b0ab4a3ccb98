"""The `aserve` command as a vLLM user types it: `aserve serve MODEL [flags]`, `aserve --version`, a busy
--port refused in a second with one line (before the model loads), and the bundled model served under
its Hub id without the network."""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys
import time

import openai
import pytest

import aserve
from aserve.config import BUNDLED_MODEL_HUB_ID, BUNDLED_MODEL_NAME
from aserve.server.args import parse_args

CLI = [sys.executable, "-m", "aserve.server.cli"]


def _run(args: list[str], timeout: float = 60) -> subprocess.CompletedProcess:
    return subprocess.run(CLI + args, capture_output=True, text=True, timeout=timeout, check=False)


@pytest.mark.parametrize("argv", [["--version"], ["serve", "--version"]])
def test_version(argv):
    out = _run(argv)
    assert out.returncode == 0 and out.stdout.strip() == f"aserve {aserve.__version__}", out


def test_serve_form_takes_the_model_as_its_first_argument():
    engine, server = parse_args(["serve", "HuggingFaceTB/SmolLM2-135M-Instruct", "--port", "9000"], environ={})
    assert engine.model == "HuggingFaceTB/SmolLM2-135M-Instruct" and server.port == 9000
    engine, _ = parse_args(["serve", "--max-model-len", "64", "/models/m"], environ={})
    assert engine.model == "/models/m" and engine.max_model_len == 64
    assert parse_args(["serve", "--model", "m"], environ={})[0].model == "m"
    assert parse_args(["serve"], environ={})[0].model == ""  # the bundled model, as `aserve`
    assert parse_args(["--model", "m"], environ={})[0].model == "m"  # `aserve [flags]` as before


def test_model_given_twice_is_refused():
    out = _run(["serve", "a", "--model", "b"])
    assert out.returncode == 2 and "the model is given twice" in out.stderr


def test_busy_port_fails_at_once_with_one_line():
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        start = time.monotonic()
        # a model that does not exist: had the engine been built first, the error would name it instead
        out = _run(["serve", "/nonexistent/model", "--host", "127.0.0.1", "--port", str(port)])
        elapsed = time.monotonic() - start
    assert out.returncode == 2
    assert out.stderr.splitlines() == [(f"aserve: error: --port {port}: cannot listen on 127.0.0.1:{port}: "
                                        "address already in use")], out.stderr
    assert elapsed < 15  # the interpreter's start and the server's imports; no model is touched


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_serve_the_bundled_model_by_its_hub_id_offline(bundled_model_path):
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    args = ["serve", BUNDLED_MODEL_HUB_ID, "--host", "127.0.0.1", "--port", "0", "--disable-log-stats",
            "--disable-log-requests", "--distributed-executor-backend", "uni", "--dtype", "float32",
            "--max-model-len", "256", "--num-gpu-blocks-override", "64"]
    proc = subprocess.Popen(CLI + args, stderr=subprocess.PIPE, stdout=subprocess.DEVNULL, text=True, env=env)
    try:
        url, log = None, []
        assert proc.stderr is not None
        for line in proc.stderr:
            log.append(line)
            match = re.search(r"serving .* on (http://\S+)", line)
            if match:
                url = match.group(1)
                break
        assert url, "".join(log)
        with openai.OpenAI(base_url=f"{url}/v1", api_key="x", max_retries=0, timeout=120) as client:
            assert [m.id for m in client.models.list().data] == [BUNDLED_MODEL_HUB_ID, BUNDLED_MODEL_NAME]
            for name in (BUNDLED_MODEL_HUB_ID, BUNDLED_MODEL_NAME):
                resp = client.chat.completions.create(model=name, messages=[{"role": "user", "content": "Hi"}],
                                                      max_tokens=3, temperature=0)
                assert resp.model == name and resp.choices[0].message.content
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(60) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
