"""The root task group: hypercorn serving the app, the engine loop and the stats logger.

    serve(engine, args)  # one anyio task group, started services report readiness via task_status

Shutdown (SIGINT/SIGTERM, or `stop` set): new requests get 503 and the listening socket closes
(connection refused); in-flight requests get `args.shutdown_grace_period` seconds to finish (then
they are cancelled, which aborts them in the engine); then the engine loop is shut down. A second
signal cancels everything at once.

Engine death (the worker process died, the device failed): the engine has already ended every
in-flight request with an error, and /health answers 503 at once. The server keeps answering for
`ENGINE_DEATH_LINGER_S` seconds (so handlers write those errors and health checks see the 503), then
shuts down like a graceful stop, and `serve` raises EngineDiedError: the process exits non-zero for
its supervisor to restart it.
"""

from __future__ import annotations

import errno
import logging
import signal
import socket
import ssl
from dataclasses import dataclass
from typing import Any

import anyio
from anyio.abc import TaskStatus
from hypercorn.asyncio import serve as hypercorn_serve
from hypercorn.config import Config as HypercornConfig

from aserve.server.app import create_app
from aserve.server.args import ServerArgs
from aserve.server.lora import register_lora_modules
from aserve.server.metrics import LoggingStatLogger
from aserve.server.state import EngineClient

logger = logging.getLogger("aserve.server")

ENGINE_DEATH_LINGER_S = 2.0


class EngineDiedError(RuntimeError):
    """The engine died while serving; the server shut down after reporting it."""


@dataclass(frozen=True)
class BoundAddress:
    host: str
    port: int
    tls: bool = False

    @property
    def url(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"{'https' if self.tls else 'http'}://{host}:{self.port}"


def python_log_level(name: str) -> int:
    return logging.DEBUG if name.lower() == "trace" else logging.getLevelName(name.upper())


class PortInUseError(OSError):
    """The address to listen on is taken (or not ours to bind); the message is one line naming it."""


def bind_socket(host: str | None, port: int) -> socket.socket:
    """A listening TCP socket (port 0 picks a free port); None binds all interfaces. Raises
    PortInUseError (one line naming --host/--port) when the address cannot be bound."""
    host = host or "0.0.0.0"
    try:
        family = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)[0][0]
        return socket.create_server((host, port), family=family, backlog=2048)
    except OSError as exc:
        reason = "address already in use" if exc.errno == errno.EADDRINUSE else (exc.strerror or str(exc))
        raise PortInUseError(f"--port {port}: cannot listen on {host}:{port}: {reason}") from None


def hypercorn_config(args: ServerArgs, sock: socket.socket) -> HypercornConfig:
    """Hypercorn settings; the server takes over `sock` (bound via its file descriptor)."""
    config = HypercornConfig()
    config.bind = [f"fd://{sock.detach()}"]
    config.graceful_timeout = args.shutdown_grace_period
    level = python_log_level(args.uvicorn_log_level)
    error_log = logging.getLogger("hypercorn.error")
    error_log.setLevel(level)
    config.errorlog = error_log
    if level <= logging.INFO:
        access_log = logging.getLogger("hypercorn.access")
        access_log.setLevel(level)
        config.accesslog = access_log
    else:
        config.accesslog = None
    if args.ssl_certfile:
        config.certfile = args.ssl_certfile
        config.keyfile = args.ssl_keyfile
        config.ca_certs = args.ssl_ca_certs
        config.verify_mode = ssl.VerifyMode(args.ssl_cert_reqs)
    return config


async def _watch_signals(
    stop: anyio.Event,
    root: anyio.CancelScope,
    grace: float,
    *,
    task_status: TaskStatus[None] = anyio.TASK_STATUS_IGNORED,
) -> None:
    with anyio.open_signal_receiver(signal.SIGINT, signal.SIGTERM) as signals:
        task_status.started()
        async for signum in signals:
            name = signal.Signals(signum).name
            if not stop.is_set():
                logger.info(
                    "%s received: refusing new requests, draining in-flight ones (up to %.0f s)", name, grace
                )
                stop.set()
            else:
                logger.warning("%s received again: stopping now", name)
                root.cancel()
                return


async def _serve_http(
    app: Any,
    config: HypercornConfig,
    shutdown_trigger: Any,
    done: anyio.Event,
    *,
    task_status: TaskStatus[None] = anyio.TASK_STATUS_IGNORED,
) -> None:
    """Hypercorn in a task of its own: on Python 3.11 its asyncio.TaskGroup can leave a stray cancellation
    request on the task that ran it, which must not be the task holding our cancel scopes."""
    task_status.started()
    try:
        await hypercorn_serve(app, config, shutdown_trigger=shutdown_trigger)
    finally:
        done.set()


async def _run_engine(
    engine: EngineClient,
    stop: anyio.Event,
    died: list[BaseException],
    *,
    task_status: TaskStatus[None] = anyio.TASK_STATUS_IGNORED,
) -> None:
    """The engine loop; if it dies, record why, linger, then trigger the shutdown."""
    try:
        await engine.run(task_status=task_status)
    except Exception as exc:
        died.append(exc)
        logger.error("the engine died (%r): answering 503 for %.0f s, then exiting", exc, ENGINE_DEATH_LINGER_S)
        await anyio.sleep(ENGINE_DEATH_LINGER_S)
        stop.set()


async def serve(
    engine: EngineClient,
    args: ServerArgs,
    *,
    stop: anyio.Event | None = None,
    handle_signals: bool = True,
    sock: socket.socket | None = None,
    task_status: TaskStatus[BoundAddress] = anyio.TASK_STATUS_IGNORED,
) -> None:
    """Run the engine loop, the stats logger and the HTTP server until `stop` is set (or a signal).

    `sock`: a listening socket bound beforehand (the CLI binds before loading the model, so a busy
    port fails at once); None binds `args.host:args.port` here.

    Reports the bound address through `task_status` once the socket listens and the engine runs.
    Returns after a graceful shutdown; raises EngineDiedError after shutting down if the engine died.
    """
    stop = stop or anyio.Event()
    if args.lora_modules:  # before serving: a bad adapter stops the start-up (LoRAModulesError naming it)
        await register_lora_modules(engine, args.lora_modules, engine.model_config.served_model_names)
    app = create_app(engine, args)
    state = app.state.aserve
    sock = sock or bind_socket(args.host, args.port)
    host, port = sock.getsockname()[:2]
    config = hypercorn_config(args, sock)

    async def shutdown_trigger() -> None:
        await stop.wait()
        state.draining = True

    died: list[BaseException] = []
    with anyio.CancelScope() as root:
        async with anyio.create_task_group() as engine_group:
            await engine_group.start(_run_engine, engine, stop, died)
            try:
                async with anyio.create_task_group() as services:
                    if handle_signals:
                        await services.start(_watch_signals, stop, root, args.shutdown_grace_period)
                    if not args.disable_log_stats:
                        stats = LoggingStatLogger(args.stats_log_interval)
                        engine.add_stat_logger(stats)
                        await services.start(stats.run)
                    http_done = anyio.Event()
                    await services.start(_serve_http, app, config, shutdown_trigger, http_done)
                    address = BoundAddress(host, port, tls=bool(args.ssl_certfile))
                    logger.info("serving %s on %s", list(state.served_model_names), address.url)
                    task_status.started(address)
                    await http_done.wait()
                    services.cancel_scope.cancel()
            finally:
                engine.shutdown()
    if root.cancelled_caught:
        logger.warning("forced shutdown")
    if died:
        raise EngineDiedError(f"the engine died: {died[0]!r}") from died[0]
    logger.info("server stopped")


def run(engine_factory: Any, args: ServerArgs, sock: socket.socket | None = None) -> None:
    """Blocking entry point: build the engine inside the event loop (asyncio + uvloop) and serve.

    `engine_factory()` is called in the loop, so it may create anyio primitives. `sock`: see `serve`.
    """

    async def main() -> None:
        engine = engine_factory()
        await serve(engine, args, sock=sock)

    anyio.run(main, backend="asyncio", backend_options={"use_uvloop": True})
