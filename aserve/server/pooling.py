"""What the pooling handlers share (`embeddings.py`, `scoring.py`): the task checks, input shapes, and
one batch of engine requests submitted together, collected together and aborted together.

One engine serves one task kind (`--task`): a generating model answers the pooling endpoints with a
400 naming `--task`, and a pooling model answers the generation endpoints likewise
(`require_generation`). Every input of a request is one engine request; they are admitted as a batch
(`ServerState.check_load`) and queued with no await in between, so they batch in the engine, and a
failure, a timeout or a client disconnect aborts all the unfinished ones.
"""

from __future__ import annotations

import uuid
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Any

import anyio
from starlette.requests import Request
from starlette.responses import Response

from aserve.config.pooling import PoolingConfig
from aserve.outputs import PoolingRequestOutput
from aserve.pooling_params import MAX_POOLING_INPUTS, PoolingParams
from aserve.server.errors import APIError, bad_request, decode_body, engine_failure, sampling_errors_as_400
from aserve.server.replies import respond
from aserve.server.state import PromptStream, ServerState, client_id_of, get_state

Prompt = str | tuple[str, str] | list[int]  # a text, a text pair (cross-encoders), or token ids
_SHAPES = "a string, a list of strings, a list of token ids, or a list of token-id lists"
_START = {
    "embed": "--task embed (an embedding model, e.g. `aserve --model all-minilm`)",
    "classify": "--task classify (a *ForSequenceClassification model)",
    "score": "--task embed (cosine scores of embeddings) or --task score (a cross-encoder)",
}


def _task_error(message: str) -> APIError:
    return APIError(400, message, param="model", code="task_not_supported")


def require_generation(state: ServerState, endpoint: str) -> None:
    """A 400 naming `--task` when the server pools instead of generating text."""
    pooling = state.pooling
    if pooling is not None:
        raise _task_error(
            f"this model serves --task {pooling.task}, not text generation: {endpoint} needs a generating "
            "model (start the server with --task generate and a causal LM); this server answers "
            "/v1/embeddings, /score, /rerank and /classify")


@dataclass
class PoolingCall:
    """A pooling endpoint's checked request: the server state, its deadline, the decoded body, the
    model name it asked for and the served pooling config."""

    state: ServerState
    deadline: float | None
    req: Any
    model: str
    pooling: PoolingConfig


async def open_pooling_call(request: Request, decoder: Any, endpoint: str, kind: str) -> PoolingCall:
    """Decodes the body, checks its `model` and that the served model can answer `endpoint` (`kind` as
    `require_pooling`); 400s naming the field or `--task` otherwise."""
    state = get_state(request)
    deadline = state.request_deadline()
    req = decode_body(await request.body(), decoder)
    model = state.check_model(req.model)
    return PoolingCall(state, deadline, req, model, require_pooling(state, endpoint, kind))


def require_pooling(state: ServerState, endpoint: str, kind: str) -> PoolingConfig:
    """The served pooling config if it can answer `endpoint`, else a 400 naming `--task`. `kind`:
    "embed" (embeddings), "classify" (a classifier's probabilities) or "score" (either: cosine
    similarity of embeddings, or a cross-encoder's scores)."""
    pooling = state.pooling
    if pooling is None:
        raise _task_error(f"this model generates text (--task generate): {endpoint} needs a pooling model; "
                          f"start the server with {_START[kind]}")
    fits = {"embed": pooling.task == "embed", "classify": pooling.is_classifier,
            "score": pooling.task == "embed" or pooling.is_classifier}[kind]
    if not fits:
        what = "a classifier head" if pooling.is_classifier else "raw pooled states" \
            if pooling.task == "encode" else "embeddings"
        raise _task_error(f"this model serves --task {pooling.task} ({what}): {endpoint} needs a model "
                          f"served with {_START[kind]}")
    return pooling


def _is_id(t: Any) -> bool:
    return isinstance(t, int) and not isinstance(t, bool)


def normalize_inputs(value: str | list[Any], param: str = "input") -> list[str | list[int]]:
    """The request's input(s) as a list of strings and token-id lists. A malformed shape, an empty
    input, or more than MAX_POOLING_INPUTS inputs is a 400 naming `param` (token-id values are checked
    by the engine's intake, against the vocabulary)."""
    if isinstance(value, str):
        if not value:
            raise bad_request("must not be an empty string", param=param)
        return [value]
    if not value:
        raise bad_request("must not be empty", param=param)
    if all(_is_id(t) for t in value):
        return [value]
    if len(value) > MAX_POOLING_INPUTS:
        raise bad_request(f"must hold at most {MAX_POOLING_INPUTS} inputs, got {len(value)}", param=param)
    if all(isinstance(v, str) for v in value):
        for i, text in enumerate(value):
            if not text:
                raise bad_request("must not be an empty string", param=f"{param}[{i}]")
        return list(value)
    if all(isinstance(v, list) for v in value):
        for i, ids in enumerate(value):
            if not ids:
                raise bad_request("must not be empty", param=f"{param}[{i}]")
            if not all(_is_id(t) for t in ids):
                raise bad_request("a token-id input must be a list of integers", param=f"{param}[{i}]")
        return list(value)
    raise bad_request(f"must be {_SHAPES}", param=param)


def check_count(num: int, param: str) -> None:
    """A 400 naming `param` unless 1 <= `num` <= MAX_POOLING_INPUTS."""
    if num < 1:
        raise bad_request("must not be empty", param=param)
    if num > MAX_POOLING_INPUTS:
        raise bad_request(f"must hold at most {MAX_POOLING_INPUTS} inputs, got {num}", param=param)


def make_params(fields: dict[str, str] | None = None, **kwargs: Any) -> PoolingParams:
    """PoolingParams(**kwargs); a bad value is a 400 naming the request's field."""
    with sampling_errors_as_400(fields):
        return PoolingParams(**kwargs)


def _truncate_limit(state: ServerState, params: PoolingParams) -> int | None:
    t = params.truncate_prompt_tokens
    return state.max_model_len if t == -1 else t


def _count_tokens(tokenizer: Any, prompts: Sequence[Prompt], limit: int | None) -> list[list[int]]:
    """Token ids of each prompt as the engine's intake will make them (text truncated on the right,
    keeping special tokens; token ids keep the last `limit`); blocking."""
    texts = [p for p in prompts if isinstance(p, str)]
    pairs = [p for p in prompts if isinstance(p, tuple)]
    kwargs: dict[str, Any] = {"add_special_tokens": True}
    if limit is not None:
        kwargs.update(truncation=True, max_length=limit)
    encoded_texts = iter(tokenizer(texts, **kwargs)["input_ids"] if texts else [])
    encoded_pairs = iter(tokenizer([a for a, _ in pairs], [b for _, b in pairs], **kwargs)["input_ids"]
                         if pairs else [])
    out: list[list[int]] = []
    for p in prompts:
        if isinstance(p, str):
            out.append(list(next(encoded_texts)))
        elif isinstance(p, tuple):
            out.append(list(next(encoded_pairs)))
        else:
            out.append(p[-limit:] if limit is not None else p)
    return out


@dataclass
class _Entry:
    request_id: str
    outputs: PromptStream
    finished: bool = False


@dataclass
class PoolingBatch:
    """A request's engine requests (one per prompt), queued together; `outputs` collects them."""

    state: ServerState
    request_id: str
    entries: list[_Entry]

    async def abort_unfinished(self) -> None:
        for e in self.entries:
            if not e.finished:
                await self.state.abort(e.request_id)

    async def outputs(self) -> list[PoolingRequestOutput]:
        """Each prompt's final output, in order. A request that failed fails the whole batch (a
        400 when its input was at fault, else a 500); the unfinished ones are aborted on the way out
        (failure, timeout, disconnect)."""
        results: list[Any] = [None] * len(self.entries)

        async def run(i: int, e: _Entry) -> None:
            async for out in e.outputs:
                if out.finished:
                    e.finished = True
                    results[i] = out
                    return

        try:
            async with anyio.create_task_group() as tg:
                for i, e in enumerate(self.entries):
                    tg.start_soon(run, i, e)
        except BaseExceptionGroup as group:
            raise engine_failure(group.exceptions[0]) from group.exceptions[0]
        finally:
            await self.abort_unfinished()  # each abort is shielded
        return results


async def submit(request: Request, state: ServerState, prefix: str, prompts: Sequence[Prompt],
                 params: PoolingParams, priority: int, params_of: Callable[[int], str],
                 fields: dict[str, str] | None = None) -> PoolingBatch:
    """Queue one engine request per prompt (token counting off the event loop, then admission and
    queueing with no await in between). `params_of(i)` names prompt i's request field for intake
    errors ("prompt" -> it; `fields` maps the other PoolingParams fields). Raises 400 / 429 / 503;
    nothing stays queued when it raises."""
    texts = [p for p in prompts if not isinstance(p, list)]
    if texts:
        state.require_tokenizer(params_of(0))
    limit = _truncate_limit(state, params)
    if limit is None:
        for i, p in enumerate(prompts):
            if not isinstance(p, list):
                state.check_text_length(sum(map(len, p)) if isinstance(p, tuple) else len(p), params_of(i))
    if limit is not None and limit > state.max_model_len:  # the engine's own check, before tokenizing
        raise bad_request(f"must be at most max_model_len ({state.max_model_len}), got {limit}",
                          param="truncate_prompt_tokens")
    token_ids = await state.run_tokenizer(lambda w: _count_tokens(w.tokenizer, prompts, limit)) if texts \
        else _count_tokens(None, prompts, limit)
    request_id = f"{prefix}-{uuid.uuid4().hex}"
    state.check_load(len(prompts), sum(len(ids) for ids in token_ids))
    entries: list[_Entry] = []
    try:
        for i, (p, ids) in enumerate(zip(prompts, token_ids, strict=True)):
            entry_id = f"{request_id}-{i}"
            prompt = p if not isinstance(p, list) else None
            # text: the counted ids (the tokenizer's truncation); a pair: the engine tokenizes it (token
            # type ids)
            engine_ids = None if isinstance(p, tuple) else ids
            with sampling_errors_as_400({**(fields or {}), "prompt": params_of(i)}):
                stream = state.add_request(entry_id, prompt, engine_ids, params, priority,
                                           client_id_of(request), admit=False)
            entries.append(_Entry(entry_id, stream))
    except BaseException:
        for e in entries:
            await state.abort(e.request_id)
        raise
    return PoolingBatch(state, request_id, entries)


async def answer(request: Request, deadline: float | None, batch: PoolingBatch,
                 build: Callable[[list[PoolingRequestOutput]], Any]) -> Response:
    """The JSON of `build(outputs)` once every prompt finished (cancelled, and aborted, on disconnect or
    at the deadline)."""

    async def collect() -> Any:
        return build(await batch.outputs())

    return await respond(request, False, _no_stream, collect, deadline)


async def _no_stream(emit: Callable[[bytes], Awaitable[None]]) -> None:  # pooling answers are never streamed
    raise AssertionError("pooling responses are not streamed")
