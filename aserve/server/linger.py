"""Lingering close: an answer sent before the request body was read still reaches the client.

A server that answers early (413 over the body limit, 401, 429, 503 while draining, 404) and then
closes the connection while the client is still uploading makes many clients lose the answer: their
write fails, the socket is reset, and what was already received is thrown away (the async `openai`
SDK reports a connection error and uploads the body again). hypercorn closes the connection as soon
as a response ends while the request body is unfinished, so `LingerMiddleware` keeps the response
open instead: it sends the answer's bytes at once, then reads and discards the rest of the body
(bounded in bytes and seconds, one chunk in memory at a time, awaiting each), and only then ends the
response. A client that finished its upload keeps its connection alive; past the bound the
connection closes as before.
"""

from __future__ import annotations

import anyio
from starlette.types import ASGIApp, Message, Receive, Scope, Send

LINGER_MIN_BYTES = 256 * 1024 * 1024  # discarded at most: max(this, 8 x the body limit)
LINGER_SECONDS = 10.0


def linger_bytes(max_request_body_bytes: int) -> int:
    """How many body bytes the server reads and discards after an early answer."""
    return max(LINGER_MIN_BYTES, 8 * max_request_body_bytes)


class LingerMiddleware:
    """Ends a response only after the request body was read to its end (or the bound passed)."""

    def __init__(self, app: ASGIApp, max_bytes: int = LINGER_MIN_BYTES,
                 max_seconds: float = LINGER_SECONDS) -> None:
        self.app = app
        self.max_bytes = max_bytes
        self.max_seconds = max_seconds

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        body_done = False

        async def tracking_receive() -> Message:
            nonlocal body_done
            message = await receive()
            if message["type"] == "http.disconnect" or not message.get("more_body", False):
                body_done = True
            return message

        async def lingering_send(message: Message) -> None:
            if body_done or message["type"] != "http.response.body" or message.get("more_body", False):
                await send(message)
                return
            if message.get("body"):
                await send({**message, "more_body": True})  # the client has the whole answer now
            await self._discard_body(tracking_receive)
            await send({"type": "http.response.body", "body": b"", "more_body": False})

        await self.app(scope, tracking_receive, lingering_send)

    async def _discard_body(self, receive: Receive) -> None:
        """Reads the rest of the body, keeping none of it, until it ends or the bound passes."""
        seen = 0
        with anyio.move_on_after(self.max_seconds):
            while seen <= self.max_bytes:
                message = await receive()
                if message["type"] != "http.request":
                    return
                seen += len(message.get("body", b""))
                if not message.get("more_body", False):
                    return
