"""Run the real launch path (`aserve.server.launch.run`: anyio + uvloop, signals, hypercorn) around the
real AsyncEngine over a fake model, for tests that need a server process:
`python -m tests.server.fake_server_main STEP_DELAY GRACE [SERVER_ARGS_JSON]` (from the repository root;
the JSON object overrides ServerArgs fields, e.g. '{"api_keys": ["k"]}')."""

from __future__ import annotations

import json
import logging
import sys
import tempfile

from aserve.engine.async_engine import AsyncEngine
from aserve.server.args import ServerArgs
from aserve.server.launch import run
from tests.support.fake_model import FakeModel, build_model_folder, engine_args, fake_executor_factory


def main() -> int:
    step_delay, grace = float(sys.argv[1]), float(sys.argv[2])
    overrides = json.loads(sys.argv[3]) if len(sys.argv) > 3 else {}
    for name, value in overrides.items():
        if isinstance(value, list):
            overrides[name] = tuple(value)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s [%(name)s] %(message)s")
    args = ServerArgs(host="127.0.0.1", port=0, shutdown_grace_period=grace, disable_log_requests=True,
                      disable_log_stats=True, **overrides)
    with tempfile.TemporaryDirectory() as tmp:
        folder = build_model_folder(tmp)
        model = FakeModel.for_folder(folder, step_delay=step_delay)
        factory = fake_executor_factory(model)
        run(lambda: AsyncEngine.from_engine_args(engine_args(folder), executor_factory=factory), args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
