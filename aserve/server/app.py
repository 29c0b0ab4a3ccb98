"""The starlette app factory: routes, middleware (CORS, root path, draining, API key), error handlers."""

from __future__ import annotations

import hmac
import logging

from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.middleware import Middleware
from starlette.middleware.cors import CORSMiddleware
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route
from starlette.types import ASGIApp, Receive, Scope, Send

from aserve.server import chat, completions, misc
from aserve.server.args import ServerArgs
from aserve.server.errors import APIError, http_error
from aserve.server.sse import ClientDisconnected
from aserve.server.state import EngineClient, ServerState

logger = logging.getLogger("aserve.server")

_GENERATION_PATHS = ("/v1/chat/completions", "/v1/completions")


def _route_path(scope: Scope) -> str:
    path: str = scope["path"]
    root = scope.get("root_path", "")
    if root and path.startswith(root) and (len(path) == len(root) or path[len(root)] == "/"):
        return path[len(root) :] or "/"
    return path


class GateMiddleware:
    """Sets the root path, refuses new requests while draining (503), and checks the API key on /v1/*."""

    def __init__(self, app: ASGIApp, state: ServerState):
        self.app = app
        self.state = state
        key = state.args.api_key
        self._expected = f"Bearer {key}".encode() if key else None

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        root = self.state.args.root_path
        if root and not scope.get("root_path"):
            scope = {**scope, "root_path": root}
        if self.state.draining:
            response = APIError(503, "the server is shutting down", code="shutting_down").to_response()
            response.headers["Connection"] = "close"
            await response(scope, receive, send)
            return
        if self._expected is not None and _route_path(scope).startswith("/v1"):
            given = b""
            for name, value in scope["headers"]:
                if name == b"authorization":
                    given = value
                    break
            if not hmac.compare_digest(given, self._expected):
                await APIError(
                    401,
                    "invalid or missing API key: send 'Authorization: Bearer <key>'",
                    code="invalid_api_key",
                ).to_response()(scope, receive, send)
                return
        await self.app(scope, receive, send)


def _api_error_handler(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, APIError)
    if _route_path(request.scope) in _GENERATION_PATHS:
        request.app.state.aserve.metrics.record_rejected("invalid_request" if exc.status < 500 else "error")
    return exc.to_response()


def _http_error_handler(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, HTTPException)
    response = http_error(exc.status_code, exc.detail).to_response()
    if exc.headers:
        response.headers.update(exc.headers)
    return response


def _disconnect_handler(request: Request, exc: Exception) -> Response:
    return Response(status_code=499)  # nobody reads it: the client is gone


def _internal_error_handler(request: Request, exc: Exception) -> Response:
    logger.error("unhandled error on %s %s", request.method, request.url.path, exc_info=exc)
    return APIError(500, f"internal server error: {type(exc).__name__}", code="internal_error").to_response()


def create_app(engine: EngineClient, server_args: ServerArgs | None = None) -> Starlette:
    """The ASGI app serving `engine`; registers the app's Prometheus logger with the engine."""
    args = server_args or ServerArgs()
    state = ServerState.create(engine, args)
    engine.add_stat_logger(state.metrics)
    routes = [
        Route("/v1/chat/completions", chat.create_chat_completion, methods=["POST"]),
        Route("/v1/completions", completions.create_completion, methods=["POST"]),
        Route("/v1/models", misc.list_models, methods=["GET"]),
        Route("/health", misc.health, methods=["GET"]),
        Route("/version", misc.version, methods=["GET"]),
        Route("/metrics", misc.metrics, methods=["GET"]),
        Route("/tokenize", misc.tokenize, methods=["POST"]),
        Route("/detokenize", misc.detokenize, methods=["POST"]),
    ]
    middleware = [
        Middleware(
            CORSMiddleware,
            allow_origins=list(args.allowed_origins),
            allow_methods=list(args.allowed_methods),
            allow_headers=list(args.allowed_headers),
            allow_credentials=args.allow_credentials,
        ),
        Middleware(GateMiddleware, state=state),
    ]
    app = Starlette(
        routes=routes,
        middleware=middleware,
        exception_handlers={
            APIError: _api_error_handler,
            HTTPException: _http_error_handler,
            ClientDisconnected: _disconnect_handler,
            Exception: _internal_error_handler,
        },
    )
    app.state.aserve = state
    return app
