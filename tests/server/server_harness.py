"""Run the real server (`aserve.server.launch.serve`: hypercorn + engine loop in one anyio task group,
on uvloop) in a blocking portal's event-loop thread, so sync and async clients can talk to it over
real HTTP on 127.0.0.1."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from functools import partial
from typing import Any

import anyio
import anyio.from_thread

from aserve.server.args import ServerArgs
from aserve.server.launch import BoundAddress, serve


def quiet_args(**kwargs: Any) -> ServerArgs:
    """ServerArgs for tests: no request or stats log lines, a short grace period."""
    base = {"disable_log_requests": True, "disable_log_stats": True, "shutdown_grace_period": 5.0}
    return ServerArgs(**{**base, **kwargs})


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
