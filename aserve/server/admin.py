"""Operator routes of vLLM's server: sleep mode (POST /sleep, POST /wake_up, GET /is_sleeping), GET|POST
/ping and GET /load.

Sleep mode needs `--enable-sleep-mode`; without it the three routes answer 404 naming the flag (vLLM
serves them only in its dev mode, else 404). They need the API key when one is set (app.py). A sleep
is refused (409, nothing done) while requests are running: vLLM requires an idle engine too; call it
when the server is idle, or retry. While asleep, generation and pooling requests get 503
(`model_sleeping`); /tokenize, /detokenize, /v1/models, /health keep working.
"""

from __future__ import annotations

from starlette.requests import Request
from starlette.responses import Response

from aserve.engine.errors import EngineBusyError
from aserve.server.errors import APIError, bad_request
from aserve.server.misc import health
from aserve.server.protocol import encoder
from aserve.server.state import EngineClient, get_state


def _json(obj: object) -> Response:
    return Response(encoder.encode(obj), media_type="application/json")


def _sleep_engine(request: Request) -> EngineClient:
    engine = get_state(request).engine
    if not engine.sleep_mode_enabled:
        raise APIError(404, "sleep mode is off: start the server with --enable-sleep-mode", code="not_found")
    return engine


async def sleep(request: Request) -> Response:
    """`?level=1` (default: release the KV cache) or `2` (the weights too). 200 (empty) once asleep;
    400 for another level; 409 while requests are running (nothing done)."""
    engine = _sleep_engine(request)
    raw = request.query_params.get("level", "1")
    if raw not in ("1", "2"):
        raise bad_request(f"level must be 1 or 2, got {raw!r}", param="level")
    try:
        await engine.sleep(int(raw))
    except EngineBusyError as exc:
        raise APIError(409, f"{exc}; retry when the server is idle", code="requests_running") from None
    return Response(status_code=200)


async def wake_up(request: Request) -> Response:
    """`?tags=weights` / `?tags=kv_cache` (repeatable; none: both) wakes only those parts; requests
    are served again once every part is awake. 200 (empty); 400 for an unknown tag."""
    engine = _sleep_engine(request)
    tags = request.query_params.getlist("tags") or None
    try:
        await engine.wake_up(tags)
    except ValueError as exc:
        raise bad_request(str(exc), param="tags") from None
    return Response(status_code=200)


async def is_sleeping(request: Request) -> Response:
    """`{"is_sleeping": bool}`: true from /sleep until every part is woken up."""
    return _json({"is_sleeping": _sleep_engine(request).is_sleeping()})


async def ping(request: Request) -> Response:
    """vLLM's /ping (GET or POST, as SageMaker calls it): the same answer as /health."""
    return await health(request)


async def load(request: Request) -> Response:
    """vLLM's `{"server_load": n}`: the requests in the engine now (waiting, running or swapped; each
    sample of an n > 1 request counts one)."""
    num_requests, _ = get_state(request).engine.queued_load(count_tokens=False)
    return _json({"server_load": num_requests})
