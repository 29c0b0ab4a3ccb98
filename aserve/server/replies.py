"""How the chat and completions handlers answer: one JSON body, or SSE chunks ending in [DONE].

Both handlers keep a job (see `ReplyJob`) with the fields every response object of a request
repeats; the helpers here build those objects, their stream usage and the stream's last events.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Any, Protocol, TypeVar

import anyio
from msgspec import UNSET, UnsetType
from starlette.requests import Request
from starlette.responses import Response

from aserve.server.errors import engine_failure, timed_out
from aserve.server.params import usage
from aserve.server.protocol import ErrorResponse, UsageInfo, encoder
from aserve.server.sse import DONE, Emit, SSEResponse, call_until_disconnect, event

if TYPE_CHECKING:
    from aserve.server.state import ServerState

R = TypeVar("R")


class ReplyJob(Protocol):
    """What a handler's job knows about its request (chat's and completions' jobs both fit)."""

    state: ServerState
    request_id: str
    model: str
    created: int
    include_usage: bool
    continuous_usage: bool
    num_completion_tokens: int

    @property
    def num_prompt_tokens(self) -> int: ...

    @property
    def num_cached_tokens(self) -> int | None:
        """Prompt tokens found in the prefix cache; None without --enable-prompt-tokens-details."""
        ...


def reply_object(job: ReplyJob, kind: Callable[..., R], choices: list[Any], **fields: Any) -> R:
    """A `kind` response or chunk for `job`'s request (id, created, model, fingerprint filled in)."""
    return kind(
        id=job.request_id,
        created=job.created,
        model=job.model,
        system_fingerprint=job.state.system_fingerprint,
        choices=choices,
        **fields,
    )


def _chunk_usage(job: ReplyJob) -> UsageInfo | None | UnsetType:
    """A content chunk's `usage`: running totals with continuous_usage_stats, null with include_usage."""
    if job.continuous_usage:
        return usage(job.num_prompt_tokens, job.num_completion_tokens, job.num_cached_tokens)
    if job.include_usage:
        return None
    return UNSET


def chunk_event(job: ReplyJob, kind: Callable[..., Any], choices: list[Any]) -> bytes:
    """One SSE event: a `kind` chunk carrying `choices` (and the usage the request asked for)."""
    return event(encoder.encode(reply_object(job, kind, choices, usage=_chunk_usage(job))))


def end_events(job: ReplyJob, kind: Callable[..., Any]) -> bytes:
    """The stream's last events: a usage-only `kind` chunk when include_usage is set, then [DONE]."""
    if not job.include_usage:
        return DONE
    total = usage(job.num_prompt_tokens, job.num_completion_tokens, job.num_cached_tokens)
    return event(encoder.encode(reply_object(job, kind, [], usage=total))) + DONE


def failure_events(exc: Exception) -> bytes:
    """The events ending a stream that failed part-way: an OpenAI error object, then [DONE]."""
    return event(encoder.encode(ErrorResponse(error=engine_failure(exc).info()))) + DONE


def _produce_until(
    deadline: float, timeout_s: float, produce: Callable[[Emit], Awaitable[None]]
) -> Callable[[Emit], Awaitable[None]]:
    async def produce_until(emit: Emit) -> None:
        sent = False

        async def tracked(data: bytes) -> None:
            nonlocal sent
            sent = True
            await emit(data)

        with anyio.move_on_at(deadline) as scope:
            await produce(tracked)  # cancelled at the deadline: its `finally` aborts the request
        if scope.cancelled_caught:
            if not sent:
                raise timed_out(timeout_s)  # nothing sent yet (SSEResponse starts on the first event): a 504
            await emit(event(timed_out(timeout_s).to_bytes()) + DONE)

    return produce_until


def _collect_until(
    deadline: float, timeout_s: float, collect: Callable[[], Awaitable[R]]
) -> Callable[[], Awaitable[R]]:
    async def collect_until() -> R:
        with anyio.move_on_at(deadline):
            return await collect()  # cancelled at the deadline: its `finally` aborts the request
        raise timed_out(timeout_s)

    return collect_until


async def respond(
    request: Request,
    stream: bool,
    produce: Callable[[Emit], Awaitable[None]],
    collect: Callable[[], Awaitable[Any]],
    deadline: float | None = None,
) -> Response:
    """SSE written by `produce` when `stream`, else the JSON of `collect()` (cancelled on disconnect).

    At `deadline` (anyio clock; --request-timeout) the work is cancelled, which aborts the engine
    request: a 504 (code "timeout") if nothing was sent yet, else an SSE error event and [DONE]."""
    if deadline is not None:
        timeout_s = request.app.state.aserve.args.request_timeout
        produce = _produce_until(deadline, timeout_s, produce)
        collect = _collect_until(deadline, timeout_s, collect)
    if stream:
        return SSEResponse(produce)
    response = await call_until_disconnect(request.receive, collect)
    return Response(encoder.encode(response), media_type="application/json")
