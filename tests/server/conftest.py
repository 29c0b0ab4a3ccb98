"""Fixtures for server tests: a small real tokenizer, the fake engine, and a real server on 127.0.0.1.

The server runs `aserve.server.launch.serve` (hypercorn + engine loop in one anyio task group, on
uvloop) inside a blocking portal's event-loop thread, so both the sync and the async OpenAI SDK
can talk to it over real HTTP.
"""

from __future__ import annotations

import contextlib
import sys
from functools import partial
from pathlib import Path
from typing import Any, Iterator

import anyio
import anyio.from_thread
import pytest

sys.path.insert(0, str(Path(__file__).parent))

from fake_engine import FakeAsyncEngine, build_tokenizer  # noqa: E402

from aserve.server.args import ServerArgs  # noqa: E402
from aserve.server.launch import BoundAddress, serve  # noqa: E402

@pytest.fixture(scope="session")
def tokenizer() -> Any:
    return build_tokenizer()


@contextlib.contextmanager
def running_server(engine: Any, args: ServerArgs | None = None) -> Iterator[BoundAddress]:
    """Serve `engine` on 127.0.0.1 (a free port) in a portal thread; stops it gracefully on exit."""
    args = ServerArgs(**{**vars(args or quiet_args()), "host": "127.0.0.1", "port": 0})
    with anyio.from_thread.start_blocking_portal("asyncio", backend_options={"use_uvloop": True}) as portal:
        stop = portal.call(anyio.Event)
        future, address = portal.start_task(partial(serve, engine, args, stop=stop, handle_signals=False))
        try:
            yield address
        finally:
            portal.call(stop.set)
            future.result(timeout=60)


def quiet_args(**kwargs: Any) -> ServerArgs:
    base = {"disable_log_requests": True, "disable_log_stats": True, "shutdown_grace_period": 5.0}
    return ServerArgs(**{**base, **kwargs})


@pytest.fixture(scope="module")
def engine(tokenizer: Any) -> FakeAsyncEngine:
    return FakeAsyncEngine(tokenizer, max_model_len=256, served_model_names=("fake-model", "fake-alias"))


@pytest.fixture(scope="module")
def server(engine: FakeAsyncEngine) -> Iterator[BoundAddress]:
    with running_server(engine, quiet_args()) as address:
        yield address


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"
