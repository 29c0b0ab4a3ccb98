"""Run the real launch path (`aserve.server.launch.run`: anyio + uvloop, signals, hypercorn) around the
fake engine, for tests that need a server process: `python fake_server_main.py STEP_DELAY GRACE`."""

from __future__ import annotations

import logging
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))

from fake_engine import FakeAsyncEngine, build_tokenizer  # noqa: E402

from aserve.server.args import ServerArgs  # noqa: E402
from aserve.server.launch import run  # noqa: E402


def main() -> int:
    step_delay, grace = float(sys.argv[1]), float(sys.argv[2])
    logging.basicConfig(level=logging.INFO, format="%(levelname)s [%(name)s] %(message)s")
    tokenizer = build_tokenizer()
    args = ServerArgs(
        host="127.0.0.1",
        port=0,
        shutdown_grace_period=grace,
        disable_log_requests=True,
        disable_log_stats=True,
    )
    run(lambda: FakeAsyncEngine(tokenizer, step_delay=step_delay), args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
