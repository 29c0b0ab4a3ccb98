"""Server-sent events and client-disconnect handling.

`SSEResponse` runs a producer coroutine that emits `data: ...\\n\\n` events, next to a task that
waits for `http.disconnect`; a disconnect cancels the producer's scope, so the producer's
(shielded) `finally` aborts its engine request. `call_until_disconnect` gives non-streaming
handlers the same behaviour.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

import anyio
from starlette.types import Receive, Scope, Send

DONE = b"data: [DONE]\n\n"

Emit = Callable[[bytes], Awaitable[None]]
T = TypeVar("T")


def event(payload: bytes) -> bytes:
    """One SSE event carrying a JSON payload."""
    return b"data: " + payload + b"\n\n"


class ClientDisconnected(Exception):
    """The client went away before the response was complete."""


async def _wait_for_disconnect(receive: Receive) -> None:
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            return


class SSEResponse:
    """An ASGI response streaming `text/event-stream`; `produce(emit)` writes the events.

    The response starts (status 200 and headers) with the first event, so an error `produce` raises
    before emitting anything is answered with its own status (a 504 timeout before the first token).
    When the client disconnects, `produce` is cancelled (its `finally` blocks run) and nothing more
    is sent.
    """

    def __init__(self, produce: Callable[[Emit], Awaitable[None]], headers: dict[str, str] | None = None):
        self.produce = produce
        self.headers = {"cache-control": "no-cache", "x-accel-buffering": "no", **(headers or {})}
        self.disconnected = False

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        raw_headers = [(b"content-type", b"text/event-stream; charset=utf-8")]
        raw_headers += [(k.encode("latin-1"), v.encode("latin-1")) for k, v in self.headers.items()]

        started = False

        async def start() -> None:
            nonlocal started
            if not started:
                started = True
                await send({"type": "http.response.start", "status": 200, "headers": raw_headers})

        async def emit(data: bytes) -> None:
            await start()
            await send({"type": "http.response.body", "body": data, "more_body": True})

        error: Exception | None = None
        async with anyio.create_task_group() as tg:

            async def watch() -> None:
                await _wait_for_disconnect(receive)
                self.disconnected = True
                tg.cancel_scope.cancel()

            tg.start_soon(watch)
            try:
                await self.produce(emit)
            except OSError:  # ASGI >= 2.4 servers report a gone client by failing send()
                self.disconnected = True
            except Exception as exc:  # re-raised below, outside the task group (no ExceptionGroup wrapping)
                error = exc
            finally:
                tg.cancel_scope.cancel()
        if error is not None:
            raise error
        if not self.disconnected:
            try:
                await start()
                await send({"type": "http.response.body", "body": b"", "more_body": False})
            except OSError:
                self.disconnected = True


async def call_until_disconnect(receive: Receive, fn: Callable[[], Awaitable[T]]) -> T:
    """Await `fn()`, cancelling it if the client disconnects first (then raise ClientDisconnected).

    Exceptions from `fn` propagate unchanged. Call it only after the request body has been read.
    """
    result: list[Any] = []
    error: list[BaseException] = []
    disconnected = False
    async with anyio.create_task_group() as tg:

        async def watch() -> None:
            nonlocal disconnected
            await _wait_for_disconnect(receive)
            disconnected = True
            tg.cancel_scope.cancel()

        tg.start_soon(watch)
        try:
            result.append(await fn())
        except Exception as exc:  # re-raised below, outside the task group (no ExceptionGroup wrapping)
            error.append(exc)
        finally:
            tg.cancel_scope.cancel()
    if error:
        raise error[0]
    if disconnected and not result:
        raise ClientDisconnected()
    return result[0]
