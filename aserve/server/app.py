"""The starlette app factory: routes, middleware (CORS, root path, draining, API key), error handlers.

The routes are listed once (`_operations`); the starlette routes, `/openapi.json` and `/docs` are all
built from that list. As in vLLM, the API key guards /v1/*; unlike vLLM, also /reset_prefix_cache
and sleep mode's /sleep, /wake_up, /is_sleeping (they change server state), the pooling routes
outside /v1 (/score, /rerank, /v2/rerank, /classify: they run the model) and /dashboard,
/dashboard/data (the page may carry the key as `?key=`: a browser cannot set the header); /health, /ping, /load,
/metrics, /version, /tokenize, /detokenize, /openapi.json and /docs stay open.
"""

from __future__ import annotations

import hashlib
import hmac
import logging
from typing import Any
from urllib.parse import parse_qs

from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.middleware import Middleware
from starlette.middleware.cors import CORSMiddleware
from starlette.requests import Request
from starlette.responses import HTMLResponse, Response
from starlette.routing import Route
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from aserve.server import admin, chat, completions, dashboard, embeddings, lora, misc, scoring
from aserve.server import pooling_protocol as pp
from aserve.server.args import ServerArgs
from aserve.server import protocol as p
from aserve.server.errors import APIError, RequestFailed, body_too_large, http_error
from aserve.server.linger import LingerMiddleware, linger_bytes
from aserve.server.metrics import CONTENT_TYPE
from aserve.server.openapi import Operation, docs_page, openapi_document
from aserve.server.sse import ClientDisconnected
from aserve.server.state import EngineClient, ServerState
from aserve.server.user_middleware import load_middleware

logger = logging.getLogger("aserve.server")

_GENERATION_PATHS = ("/v1/chat/completions", "/v1/completions")
_SCORE_PATHS = ("/score", "/v1/score")
_RERANK_PATHS = ("/rerank", "/v1/rerank", "/v2/rerank")
# Requests that reach the engine: the early 429 and the rejection metrics cover them
_ENGINE_PATHS = frozenset(_GENERATION_PATHS + ("/v1/embeddings", "/classify") + _SCORE_PATHS + _RERANK_PATHS)
# outside /v1, yet guarded by the API key: a change of server state, and routes that run the model
_KEYED_PATHS = frozenset({"/reset_prefix_cache", "/score", "/rerank", "/v2/rerank", "/classify",
                          "/sleep", "/wake_up", "/is_sleeping", "/dashboard", "/dashboard/data"})


def requires_api_key(path: str) -> bool:
    """Whether `path` (without the root path) needs the API key when one is set."""
    return path.startswith("/v1") or path in _KEYED_PATHS


def _route_path(scope: Scope) -> str:
    path: str = scope["path"]
    root = scope.get("root_path", "")
    if root and path.startswith(root) and (len(path) == len(root) or path[len(root)] == "/"):
        return path[len(root) :] or "/"
    return path


def client_id_of(key: str) -> str:
    """What identifies an API key's requests to the engine (fair sharing): a hash, never the key."""
    return hashlib.sha256(key.encode()).hexdigest()[:16]


class GateMiddleware:
    """Sets the root path, refuses new requests while draining (503), checks the API key where
    `requires_api_key` says so (with several keys, the key's `client_id_of` goes in
    `scope["state"]["client_id"]` for fair sharing), refuses generation requests while the queue is
    at --max-num-queued-reqs (429, before the body is read), and refuses bodies over
    --max-request-body-bytes (413: by Content-Length before reading, else as the body streams in).
    Every early answer reaches the client: `LingerMiddleware` reads the unread body after it."""

    def __init__(self, app: ASGIApp, state: ServerState):
        self.app = app
        self.state = state
        keys = state.args.api_keys
        self._expected = [
            (f"Bearer {key}".encode(), client_id_of(key) if len(keys) > 1 else None) for key in keys
        ]
        self._max_body = state.args.max_request_body_bytes

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
        if self._expected and requires_api_key(_route_path(scope)):
            given = b""
            for name, value in scope["headers"]:
                if name == b"authorization":
                    given = value
                    break
            if not given and _route_path(scope) == "/dashboard":  # the page, opened in a browser
                key = parse_qs(scope.get("query_string", b"").decode("latin-1")).get("key")
                given = f"Bearer {key[0]}".encode() if key else b""
            matched = [client for expected, client in self._expected if hmac.compare_digest(given, expected)]
            if not matched:
                await APIError(
                    401,
                    "invalid or missing API key: send 'Authorization: Bearer <key>'",
                    code="invalid_api_key",
                ).to_response()(scope, receive, send)
                return
            if matched[0] is not None:
                scope = {**scope, "state": {**scope.get("state", {}), "client_id": matched[0]}}
        engine_path = scope["method"] == "POST" and _route_path(scope) in _ENGINE_PATHS
        if engine_path:
            self.state.metrics.record_received()
            try:
                self.state.check_queue_not_full()
            except APIError as exc:
                self.state.metrics.record_rejected("overloaded")
                await exc.to_response()(scope, receive, send)
                return
        if self._max_body:
            limit = self._max_body
            for name, value in scope["headers"]:
                if name == b"content-length" and value.isdigit() and int(value) > limit:
                    if engine_path:
                        self.state.metrics.record_rejected("invalid_request")
                    await body_too_large(limit).to_response()(scope, receive, send)
                    return
            receive = _limited(receive, limit)
        await self.app(scope, receive, send)


def _limited(receive: Receive, limit: int) -> Receive:
    """`receive` that raises a 413 APIError once the body passes `limit` bytes (a body sent without
    Content-Length, or longer than it said), so the handler stops before any tokenizing."""
    seen = 0

    async def limited_receive() -> Message:
        nonlocal seen
        message = await receive()
        if message["type"] == "http.request":
            seen += len(message.get("body", b""))
            if seen > limit:
                raise body_too_large(limit)
        return message

    return limited_receive


def _api_error_handler(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, APIError)
    # A timeout counts as an abort, and a request the engine failed was counted by the engine (its finish).
    already_counted = exc.status == 504 or isinstance(exc.__cause__, RequestFailed)
    if _route_path(request.scope) in _ENGINE_PATHS and not already_counted:
        reason = "overloaded" if exc.status == 429 else "invalid_request" if exc.status < 500 else "error"
        request.app.state.aserve.metrics.record_rejected(reason)
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


def _operations(runtime_lora_updates: bool = False) -> list[Operation]:
    """Every API route with its request and response types (the source of routes and OpenAPI);
    `runtime_lora_updates` adds vLLM's adapter load / unload routes."""
    lora_ops = [
        Operation("POST", "/v1/load_lora_adapter", lora.load_lora_adapter,
                  "Load a LoRA adapter under a name (vLLM API; needs VLLM_ALLOW_RUNTIME_LORA_UPDATING=True)",
                  request=lora.LoadLoRAAdapterRequest, text_response="text/plain"),
        Operation("POST", "/v1/unload_lora_adapter", lora.unload_lora_adapter,
                  "Unload a LoRA adapter (vLLM API; needs VLLM_ALLOW_RUNTIME_LORA_UPDATING=True)",
                  request=lora.UnloadLoRAAdapterRequest, text_response="text/plain"),
    ] if runtime_lora_updates else []
    return lora_ops + [
        Operation(
            "POST",
            "/v1/chat/completions",
            chat.create_chat_completion,
            "Create a chat completion (OpenAI API)",
            request=p.ChatCompletionRequest,
            response=p.ChatCompletionResponse,
            stream_chunk=p.ChatCompletionChunk,
        ),
        Operation(
            "POST",
            "/v1/completions",
            completions.create_completion,
            "Create a text completion (OpenAI API)",
            request=p.CompletionRequest,
            response=p.CompletionResponse,
            stream_chunk=p.CompletionResponse,
        ),
        Operation("POST", "/v1/embeddings", embeddings.create_embedding,
                  "Create embeddings (OpenAI API; a model served with --task embed)",
                  request=pp.EmbeddingRequest, response=pp.EmbeddingResponse),
        *[Operation("POST", path, scoring.create_score,
                    "Score text pairs: a cross-encoder's scores or the cosine similarity of embeddings (vLLM API)",
                    request=pp.ScoreRequest, response=pp.ScoreResponse) for path in _SCORE_PATHS],
        *[Operation("POST", path, scoring.create_rerank,
                    "Rerank documents against a query, best first (Jina / Cohere API, as vLLM serves it)",
                    request=pp.RerankRequest, response=pp.RerankResponse) for path in _RERANK_PATHS],
        Operation("POST", "/classify", embeddings.create_classification,
                  "Classify texts (vLLM API; a *ForSequenceClassification model)",
                  request=pp.ClassificationRequest, response=pp.ClassificationResponse),
        Operation("GET", "/v1/models", misc.list_models, "List the served model names", response=p.ModelList),
        Operation("GET", "/health", misc.health, "200 (empty) while the engine is healthy, 503 otherwise"),
        Operation("GET", "/version", misc.version, "The aserve version", response=dict[str, str]),
        Operation(
            "GET", "/metrics", misc.metrics, "Prometheus metrics", text_response=CONTENT_TYPE
        ),
        Operation(
            "POST",
            "/tokenize",
            misc.tokenize,
            "Tokenize a prompt or chat messages (vLLM API)",
            request=p.TokenizeRequest,
            response=p.TokenizeResponse,
        ),
        Operation(
            "POST",
            "/detokenize",
            misc.detokenize,
            "Turn token ids back into text (vLLM API)",
            request=p.DetokenizeRequest,
            response=p.DetokenizeResponse,
        ),
        Operation(
            "POST",
            "/reset_prefix_cache",
            misc.reset_prefix_cache,
            "Forget every cached prefix block (vLLM API); 409 while requests hold blocks",
        ),
        Operation("POST", "/sleep", admin.sleep, "Sleep mode (--enable-sleep-mode): ?level=1 releases the KV "
                  "cache, ?level=2 the weights too; 409 while requests run"),
        Operation("POST", "/wake_up", admin.wake_up, "Sleep mode: wake up (?tags=weights|kv_cache: only those parts)"),
        Operation("GET", "/is_sleeping", admin.is_sleeping, "Sleep mode: whether the model is asleep",
                  response=dict[str, bool]),
        Operation("GET", "/ping", admin.ping, "The same as /health (vLLM API)"),
        Operation("POST", "/ping", admin.ping, "The same as /health (vLLM API)"),
        Operation("GET", "/load", admin.load, "Requests in the engine now (vLLM API)", response=dict[str, int]),
        Operation("GET", "/dashboard", dashboard.dashboard_page,
                  "A live status page (polls /dashboard/data); with an API key set, open it as /dashboard?key=KEY",
                  text_response="text/html"),
        Operation("GET", "/dashboard/data", dashboard.dashboard_data,
                  "The dashboard's data: KV blocks, queues, totals, latency percentiles, recent series, "
                  "in-flight requests", response=dict[str, Any]),
    ]


def create_app(engine: EngineClient, server_args: ServerArgs | None = None) -> Starlette:
    """The ASGI app serving `engine`; registers the app's Prometheus logger with the engine."""
    args = server_args or ServerArgs()
    state = ServerState.create(engine, args)
    engine.add_stat_logger(state.metrics)
    engine.add_stat_logger(state.drain_rate)
    dashboard_stats = dashboard.DashboardStats()
    engine.add_stat_logger(dashboard_stats)
    operations = _operations(runtime_lora_updates=state.lora_enabled and lora.runtime_updates_allowed())
    doc = openapi_document(
        operations,
        title="aserve",
        version=state.version,
        root_path=args.root_path,
        requires_key=requires_api_key if args.api_keys else None,
    )
    doc_bytes = p.encoder.encode(doc)
    page = docs_page(doc)

    async def openapi_json(request: Request) -> Response:
        return Response(doc_bytes, media_type="application/json")

    async def docs(request: Request) -> Response:
        return HTMLResponse(page)

    routes = [Route(op.path, op.endpoint, methods=[op.method]) for op in operations]
    routes += [
        Route("/openapi.json", openapi_json, methods=["GET"]),
        Route("/docs", docs, methods=["GET"]),
    ]
    middleware = [
        Middleware(LingerMiddleware, max_bytes=linger_bytes(args.max_request_body_bytes)),
        Middleware(
            CORSMiddleware,
            allow_origins=list(args.allowed_origins),
            allow_methods=list(args.allowed_methods),
            allow_headers=list(args.allowed_headers),
            allow_credentials=args.allow_credentials,
        ),
        Middleware(GateMiddleware, state=state),
        *load_middleware(args.middleware),
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
    app.state.dashboard = dashboard_stats
    return app
