"""CI smoke of the README's serve command: `aserve --port 0` on the bundled model, /health, one
streamed chat completion through the `openai` SDK, SIGTERM, exit status 0.

Usage: python .ci/serve_smoke.py  (run inside the venv the README's commands installed into).
"""

from __future__ import annotations

import re
import signal
import subprocess
import sys
import threading
import time

import httpx
import openai

READY_TIMEOUT_S = 300.0


def main() -> int:
    server = subprocess.Popen(
        ["aserve", "--port", "0", "--host", "127.0.0.1"],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    url: list[str] = []
    lines: list[str] = []

    def read_log() -> None:
        assert server.stdout is not None
        for line in server.stdout:
            lines.append(line)
            print("  [aserve] " + line, end="", flush=True)
            found = re.search(r"serving .* on (http://\S+)", line)
            if found and not url:
                url.append(found.group(1))

    reader = threading.Thread(target=read_log, daemon=True)
    reader.start()
    try:
        deadline = time.monotonic() + READY_TIMEOUT_S
        while not url:
            if server.poll() is not None or time.monotonic() > deadline:
                print(f"smoke: the server did not start (exit {server.poll()})", file=sys.stderr)
                return 1
            time.sleep(0.2)
        base = url[0]
        assert httpx.get(f"{base}/health", timeout=10).status_code == 200
        client = openai.OpenAI(base_url=f"{base}/v1", api_key="none", max_retries=0)
        model = client.models.list().data[0].id
        stream = client.chat.completions.create(
            model=model,
            messages=[{"role": "user", "content": "Say hello in three words."}],
            max_tokens=16,
            temperature=0,
            stream=True,
        )
        pieces = [c.choices[0].delta.content or "" for c in stream if c.choices]
        text = "".join(pieces)
        print(f"smoke: {len(pieces)} chunks: {text!r}")
        if not text.strip():
            print("smoke: the streamed answer is empty", file=sys.stderr)
            return 1
    finally:
        if server.poll() is None:
            server.send_signal(signal.SIGTERM)
        try:
            code = server.wait(timeout=60)
        except subprocess.TimeoutExpired:
            server.kill()
            code = -9
        reader.join(timeout=5)
    print(f"smoke: the server exited with {code} after SIGTERM")
    return 0 if code == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
