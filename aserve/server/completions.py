"""POST /v1/completions: one engine request per prompt; choices are numbered prompt * n + sample."""

from __future__ import annotations

import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

import anyio
import msgspec
from msgspec import UNSET
from starlette.requests import Request
from starlette.responses import Response

from aserve.outputs import RequestOutput
from aserve.sampling_params import MAX_PROMPTS
from aserve.server.errors import (
    bad_request,
    decode_body,
    engine_failure,
    sampling_errors_as_400,
    unsupported,
)
from aserve.server.params import (
    append_completion_logprobs,
    build_sampling_params,
    guided_decoding_from_request,
    check_stream_options,
    prompt_logprobs_dicts,
    usage,
)
from aserve.server.protocol import (
    CompletionChoice,
    CompletionLogprobs,
    CompletionRequest,
    CompletionResponse,
)
from aserve.server.replies import chunk_event, end_events, failure_events, reply_object, respond
from aserve.server.sse import Emit
from aserve.server.pooling import require_generation
from aserve.server.state import ServerState, client_id_of, get_state, logger, trace_headers_of

_decoder = msgspec.json.Decoder(CompletionRequest)
_PROMPT_SHAPES = "a string, a list of strings, a list of token ids, or a list of token-id lists"


def normalize_prompts(prompt: str | list[Any]) -> list[str | list[Any]]:
    """The request's prompt(s) as a list of strings and token-id lists; a malformed shape (or more than
    MAX_PROMPTS prompts) is a 400. Token-id values are checked at intake, against the vocabulary."""
    if isinstance(prompt, str):
        return [prompt]
    if not prompt:
        raise bad_request("must not be empty", param="prompt")

    def is_id(t: Any) -> bool:
        return isinstance(t, int) and not isinstance(t, bool)

    if all(is_id(p) for p in prompt):
        return [prompt]
    if len(prompt) > MAX_PROMPTS:
        raise bad_request(f"must hold at most {MAX_PROMPTS} prompts, got {len(prompt)}", param="prompt")
    if all(isinstance(p, str) for p in prompt):
        return list(prompt)
    if all(isinstance(p, list) for p in prompt):
        for i, ids in enumerate(prompt):
            if not all(is_id(t) for t in ids):
                raise bad_request("a token-id prompt must be a list of integers", param=f"prompt[{i}]")
        return list(prompt)
    raise bad_request(f"must be {_PROMPT_SHAPES}", param="prompt")


@dataclass
class _Prompt:
    index: int
    request_id: str
    text: str  # as given, or decoded from the given token ids (for echo)
    token_ids: list[int]
    outputs: AsyncIterator[RequestOutput]
    finished: bool = False
    num_cached_tokens: int = 0  # prompt tokens found in the prefix cache (the engine's latest word)


@dataclass
class _CompletionJob:
    state: ServerState
    request_id: str
    model: str
    created: int
    prompts: list[_Prompt]
    n: int
    echo: bool
    logprobs: int | None
    prompt_logprobs: int | None
    include_usage: bool
    continuous_usage: bool
    num_completion_tokens: int = 0
    offsets: dict[int, int] = field(default_factory=dict)

    @property
    def num_prompt_tokens(self) -> int:
        return sum(len(p.token_ids) for p in self.prompts)

    @property
    def num_cached_tokens(self) -> int | None:
        if not self.state.args.enable_prompt_tokens_details:
            return None
        return sum(p.num_cached_tokens for p in self.prompts)


def _reject_unsupported(req: CompletionRequest) -> None:
    if req.suffix:
        raise unsupported("suffix", "insertion (fill-in-the-middle) is not implemented")
    if req.stream and req.best_of is not None and req.best_of != (req.n or 1):
        raise bad_request("best_of must equal n when streaming", param="best_of")
    if req.stream and req.prompt_logprobs is not None:
        raise unsupported("prompt_logprobs", "not available when streaming")


def _tokenize_all(
    tokenizer: Any, prompts: list[str | list[Any]], add_special_tokens: bool
) -> list[list[Any]]:
    """Token ids of each prompt (text prompts encoded; token-id prompts as given, checked at intake)."""
    return [
        tokenizer.encode(p, add_special_tokens=add_special_tokens) if isinstance(p, str) else p
        for p in prompts
    ]


async def create_completion(request: Request) -> Response:
    state = get_state(request)
    deadline = state.request_deadline()
    req = decode_body(await request.body(), _decoder)
    model = state.check_model(req.model)
    require_generation(state, "/v1/completions")
    _reject_unsupported(req)
    include_usage, continuous_usage = check_stream_options(req)
    raw_prompts = normalize_prompts(req.prompt)
    batched = isinstance(req.prompt, list) and raw_prompts[0] is not req.prompt  # a list of prompts
    for i, p in enumerate(raw_prompts):
        if isinstance(p, str):
            state.require_tokenizer("prompt")
            state.check_text_length(len(p), f"prompt[{i}]" if batched else "prompt")
    tokenized = (await state.run_tokenizer(lambda w: _tokenize_all(w.tokenizer, raw_prompts, req.add_special_tokens))
                 if state.tokenizers is not None else _tokenize_all(None, raw_prompts, req.add_special_tokens))
    stream = bool(req.stream)
    echo = bool(req.echo)
    prompt_logprobs = req.prompt_logprobs
    if echo and req.logprobs is not None:
        prompt_logprobs = max(req.logprobs, prompt_logprobs or 0)
    # Intake names SamplingParams' fields; these are the request's names for them.
    fields = {"prompt_logprobs": "prompt_logprobs" if req.prompt_logprobs is not None else "logprobs"}
    if req.response_format is not None:
        fields.update(guided_json="response_format", json_object="response_format")
    with sampling_errors_as_400(fields):
        guided = guided_decoding_from_request(req)
        params = build_sampling_params(
            req,
            max_tokens=req.max_tokens,
            logprobs=req.logprobs,
            stream=stream,
            best_of=req.best_of,
            prompt_logprobs=prompt_logprobs,
            defaults=state.generation_defaults,
            guided_decoding=guided,
            logits_processor_pattern=state.model_config.logits_processor_pattern,
        )
        await state.run_blocking(state.check_guided_decoding, params)  # compiles off the event loop

    request_id = f"cmpl-{uuid.uuid4().hex}"
    prompts: list[_Prompt] = []
    try:
        for i, (raw, ids) in enumerate(zip(raw_prompts, tokenized, strict=True)):
            param = f"prompt[{i}]" if batched else "prompt"
            entry_id = f"{request_id}-{i}"
            with sampling_errors_as_400({**fields, "prompt": param}):
                outputs = state.add_request(
                    entry_id, raw if isinstance(raw, str) else None, ids, params, req.priority,
                    client_id_of(request), state.lora_request_for(model), trace_headers=trace_headers_of(request),
                )
            kept = outputs.prompt_token_ids
            text = raw if isinstance(raw, str) and len(kept) == len(ids) else ""
            if echo and not text and state.tokenizer is not None:  # echo what the model saw
                text = await state.run_tokenizer(lambda w: w.tokenizer.decode(kept))
            prompts.append(_Prompt(i, entry_id, text, kept, outputs))
    except BaseException:
        for p in prompts:
            await state.abort(p.request_id)
        raise

    job = _CompletionJob(
        state,
        request_id,
        model,
        int(time.time()),
        prompts,
        params.n,
        echo,
        req.logprobs,
        req.prompt_logprobs,
        include_usage,
        continuous_usage,
    )
    return await respond(request, stream, lambda emit: _stream(job, emit), lambda: _collect(job), deadline)


async def _abort_unfinished(job: _CompletionJob) -> None:
    for p in job.prompts:
        if not p.finished:
            await job.state.abort(p.request_id)


@dataclass
class _Sample:
    text: list[str] = field(default_factory=list)
    token_ids: list[int] = field(default_factory=list)
    positions: list[Any] = field(default_factory=list)
    finish_reason: str | None = None
    stop_reason: Any = None
    cumulative_logprob: float | None = None


async def _collect_prompt(p: _Prompt) -> tuple[dict[int, _Sample], Any]:
    samples: dict[int, _Sample] = {}
    prompt_positions = None
    async for out in p.outputs:
        p.num_cached_tokens = out.num_cached_tokens
        if prompt_positions is None and out.prompt_logprobs is not None:
            prompt_positions = out.prompt_logprobs
        for c in out.outputs:
            s = samples.setdefault(c.index, _Sample())
            s.text.append(c.text)
            s.token_ids.extend(c.token_ids)
            if c.logprobs:
                s.positions.extend(c.logprobs)
            s.finish_reason, s.stop_reason = c.finish_reason, c.stop_reason
            s.cumulative_logprob = c.cumulative_logprob
        if out.finished:
            p.finished = True
            break
    return samples, prompt_positions


async def _collect(job: _CompletionJob) -> CompletionResponse:
    state = job.state
    results: list[Any] = [None] * len(job.prompts)
    try:
        async with anyio.create_task_group() as tg:

            async def run(p: _Prompt) -> None:
                results[p.index] = await _collect_prompt(p)

            for p in job.prompts:
                tg.start_soon(run, p)
    except BaseExceptionGroup as group:  # one prompt's failure fails the request; report the first cause
        raise engine_failure(group.exceptions[0]) from group.exceptions[0]
    finally:
        await _abort_unfinished(job)

    choices: list[CompletionChoice] = []
    num_completion = 0
    for p, (samples, prompt_positions) in zip(job.prompts, results, strict=True):
        # The engine returns the n best of best_of samples, indexed 0..n-1.
        for k, i in enumerate(sorted(samples)):
            s = samples[i]
            num_completion += len(s.token_ids)
            prefix = p.text if job.echo else ""
            logprobs = None
            if job.logprobs is not None:
                logprobs = CompletionLogprobs()
                offset = 0
                if job.echo:
                    offset = append_completion_logprobs(
                        logprobs, state.decode_token, p.token_ids, prompt_positions, job.logprobs, 0
                    )
                append_completion_logprobs(
                    logprobs, state.decode_token, s.token_ids, s.positions, job.logprobs, offset
                )
            choice = CompletionChoice(
                index=p.index * job.n + k,
                text=prefix + "".join(s.text),
                logprobs=logprobs,
                finish_reason=s.finish_reason,
                stop_reason=s.stop_reason,
            )
            if job.prompt_logprobs is not None:
                choice.prompt_logprobs = prompt_logprobs_dicts(
                    state.decode_token, p.token_ids, prompt_positions, job.prompt_logprobs
                )
            choices.append(choice)
    return reply_object(job, CompletionResponse, choices, usage=usage(job.num_prompt_tokens, num_completion, job.num_cached_tokens))


def _chunk(job: _CompletionJob, choice: CompletionChoice) -> bytes:
    return chunk_event(job, CompletionResponse, [choice])


def _echo_chunks(job: _CompletionJob, p: _Prompt, prompt_positions: Any) -> list[bytes]:
    """The first chunk of each of the prompt's choices when echoing: the prompt text (and its logprobs)."""
    chunks = []
    for i in range(job.n):
        index = p.index * job.n + i
        logprobs = None
        if job.logprobs is not None:
            logprobs = CompletionLogprobs()
            job.offsets[index] = append_completion_logprobs(
                logprobs, job.state.decode_token, p.token_ids, prompt_positions, job.logprobs, 0
            )
        else:
            job.offsets[index] = len(p.text)
        chunks.append(
            _chunk(job, CompletionChoice(index=index, text=p.text, logprobs=logprobs, finish_reason=None))
        )
    return chunks


async def _stream_prompt(job: _CompletionJob, p: _Prompt, emit: Emit) -> None:
    state = job.state
    echoed = not job.echo
    async for out in p.outputs:
        p.num_cached_tokens = out.num_cached_tokens
        events = []
        if not echoed:  # wait for the first output: it carries the prompt logprobs
            events.extend(_echo_chunks(job, p, out.prompt_logprobs))
            echoed = True
        for c in out.outputs:
            job.num_completion_tokens += len(c.token_ids)
            if not c.text and not c.token_ids and c.finish_reason is None:
                continue
            index = p.index * job.n + c.index
            logprobs = None
            if job.logprobs is not None:
                logprobs = CompletionLogprobs()
                job.offsets[index] = append_completion_logprobs(
                    logprobs,
                    state.decode_token,
                    c.token_ids,
                    c.logprobs,
                    job.logprobs,
                    job.offsets.get(index, 0),
                )
            finished = c.finish_reason is not None
            events.append(
                _chunk(
                    job,
                    CompletionChoice(
                        index=index,
                        text=c.text,
                        logprobs=logprobs,
                        finish_reason=c.finish_reason,
                        stop_reason=c.stop_reason if finished else UNSET,
                    ),
                )
            )
        if out.finished:
            p.finished = True
        if events:
            await emit(b"".join(events))
        if p.finished:
            break


async def _stream(job: _CompletionJob, emit: Emit) -> None:
    try:
        try:
            async with anyio.create_task_group() as tg:
                for p in job.prompts:
                    tg.start_soon(_stream_prompt, job, p, emit)
        except BaseExceptionGroup as group:
            raise group.exceptions[0] from None
        await emit(end_events(job, CompletionResponse))
    except OSError:
        raise
    except Exception as exc:
        logger.exception("completion request %s failed while streaming", job.request_id)
        await emit(failure_events(exc))
    finally:
        await _abort_unfinished(job)
