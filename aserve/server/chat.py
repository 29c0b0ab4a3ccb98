"""POST /v1/chat/completions: render the conversation, submit, answer as JSON or as SSE chunks."""

from __future__ import annotations

import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

import msgspec
from msgspec import UNSET
from starlette.requests import Request
from starlette.responses import Response

from aserve.outputs import RequestOutput
from aserve.server.errors import (
    bad_request,
    decode_body,
    engine_failure,
    sampling_errors_as_400,
    unsupported,
)
from aserve.server.chat_outputs import ChatOutputPlan, ChoiceOutput
from aserve.server.params import (
    build_sampling_params,
    chat_logprobs,
    check_stream_options,
    default_max_tokens,
    guided_decoding_from_request,
    usage,
)
from aserve.server.protocol import (
    ChatChoice,
    ChatChunkChoice,
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatLogprobs,
    ChatMessage,
    ChatResponseMessage,
    ContentPart,
    DeltaMessage,
    TextPart,
)
from aserve.server.chat_template import content_text
from aserve.server.replies import chunk_event, end_events, failure_events, reply_object, respond
from aserve.server.sse import Emit
from aserve.server.pooling import require_generation
from aserve.server.state import ServerState, client_id_of, get_state, logger, trace_headers_of

_decoder = msgspec.json.Decoder(ChatCompletionRequest)


def _message_text(i: int, content: list[ContentPart]) -> str:
    """The text parts of a message joined with newlines; any other modality is a 400."""
    texts = []
    for j, part in enumerate(content):
        if not isinstance(part, TextPart):
            kind = type(part).__struct_config__.tag
            raise unsupported(f"messages[{i}].content[{j}].type",
                              f"only text content parts are served, got type {kind!r}")
        texts.append(part.text)
    return "\n".join(texts)


def to_conversation(messages: list[ChatMessage], content_format: str = "auto") -> list[dict[str, Any]]:
    """Messages as the plain dicts chat templates expect (--chat-template-content-format): "string" (and
    "auto") joins text parts with newlines; "openai" gives every content as a list of
    `{"type": "text", "text": ...}` parts (a string content becomes one part), as vLLM does."""
    if not messages:
        raise bad_request("must contain at least one message", param="messages")
    conversation: list[dict[str, Any]] = []
    for i, message in enumerate(messages):
        for name in ("audio", "function_call"):  # what an echoed assistant message may carry
            if getattr(message, name):
                raise unsupported(f"messages[{i}].{name}", "use `content` (and `tool_calls`) instead")
        content = message.content
        if isinstance(content, list):
            content = _message_text(i, content)
        if content is None and not message.tool_calls:
            content = ""
        if content_format == "openai" and content is not None:
            parts = message.content if isinstance(message.content, list) else [content]
            content = [{"type": "text", "text": p if isinstance(p, str) else p.text} for p in parts]
        entry: dict[str, Any] = {"role": message.role, "content": content}
        for name in ("name", "tool_call_id", "tool_calls", "reasoning_content", "refusal"):
            value = getattr(message, name)
            if value:
                entry[name] = value
        conversation.append(entry)
    return conversation


def _reject_unsupported(req: ChatCompletionRequest) -> None:
    """OpenAI fields whose request cannot be honoured here (ignoring them would change the answer)."""
    if req.modalities and "audio" in req.modalities:
        raise unsupported("modalities", "only text output is served")
    if req.audio is not None:
        raise unsupported("audio", "only text output is served")
    if req.web_search_options is not None:
        raise unsupported("web_search_options", "this server has no web search")
    if req.functions is not None:
        raise unsupported("functions", "use `tools` (the legacy functions API is not served)")
    if req.function_call is not None:
        raise unsupported("function_call", "use `tool_choice` (the legacy functions API is not served)")


def _template_kwargs(req: ChatCompletionRequest) -> dict[str, Any] | None:
    """The chat template's extra variables: `chat_template_kwargs`, plus `reasoning_effort` (templates of
    reasoning models read it, e.g. gpt-oss's); the two may not disagree."""
    kwargs = req.chat_template_kwargs
    if req.reasoning_effort is None:
        return kwargs
    kwargs = dict(kwargs or {})
    if kwargs.setdefault("reasoning_effort", req.reasoning_effort) != req.reasoning_effort:
        raise bad_request("reasoning_effort contradicts chat_template_kwargs.reasoning_effort",
                          param="reasoning_effort")
    return kwargs


def _top_logprobs(req: ChatCompletionRequest) -> int | None:
    """The number of candidates per position to return, or None without logprobs (the range,
    up to --max-logprobs, is checked at intake as SamplingParams.logprobs)."""
    if req.top_logprobs is not None and not req.logprobs:
        raise bad_request("top_logprobs requires logprobs to be true", param="top_logprobs")
    if not req.logprobs:
        return None
    return req.top_logprobs or 0


@dataclass
class _ChatJob:
    state: ServerState
    request_id: str
    model: str
    created: int
    role: str
    echo_text: str
    num_prompt_tokens: int
    n: int
    top_logprobs: int | None
    include_usage: bool
    continuous_usage: bool
    outputs: AsyncIterator[RequestOutput]
    plan: ChatOutputPlan
    prompt: str
    num_completion_tokens: int = 0
    num_cached: int = 0  # prompt tokens found in the prefix cache (the engine's latest word)

    @property
    def num_cached_tokens(self) -> int | None:
        return self.num_cached if self.state.args.enable_prompt_tokens_details else None


async def create_chat_completion(request: Request) -> Response:
    state = get_state(request)
    deadline = state.request_deadline()
    req = decode_body(await request.body(), _decoder)
    model = state.check_model(req.model)
    require_generation(state, "/v1/chat/completions")
    state.require_tokenizer("messages")
    _reject_unsupported(req)
    plan = ChatOutputPlan.from_request(req, state.args)
    include_usage, continuous_usage = check_stream_options(req)
    top_logprobs = _top_logprobs(req)
    conversation = to_conversation(req.messages, state.args.chat_template_content_format)
    num_chars = sum(len(content_text(m["content"])) for m in conversation)
    state.check_text_length(num_chars, "messages")
    prompt, prompt_ids = await state.run_tokenizer(lambda w: w.renderer.render_and_tokenize(
        conversation,
        add_special_tokens=req.add_special_tokens,
        add_generation_prompt=req.add_generation_prompt,
        continue_final_message=req.continue_final_message,
        chat_template=req.chat_template,
        chat_template_kwargs=_template_kwargs(req),
        tools=req.tools,
    ))
    requested = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
    max_tokens_param = "max_completion_tokens" if req.max_completion_tokens is not None else "max_tokens"
    defaults = state.generation_defaults
    if requested is None:
        requested = default_max_tokens(
            defaults, len(prompt_ids), req.truncate_prompt_tokens, state.max_model_len
        )
    stream = bool(req.stream)
    fields = {"prompt": "messages", "logprobs": "top_logprobs", "max_tokens": max_tokens_param}
    if req.response_format is not None:
        fields.update(guided_json="response_format", json_object="response_format")
    if plan.tool_grammar is not None:
        fields.update(guided_json="tools")
    with sampling_errors_as_400(fields):
        guided = _guided_decoding(req, plan, prompt, state)
        params = build_sampling_params(
            req, max_tokens=requested, logprobs=top_logprobs, stream=stream, defaults=defaults,
            guided_decoding=guided, logits_processor_pattern=state.model_config.logits_processor_pattern,
        )
        await state.run_blocking(state.check_guided_decoding, params)  # compiles off the event loop
        request_id = f"chatcmpl-{uuid.uuid4().hex}"
        outputs = state.add_request(
            request_id, prompt, prompt_ids, params, req.priority, client_id_of(request), state.lora_request_for(model),
            trace_headers=trace_headers_of(request),
        )
    if len(outputs.prompt_token_ids) < len(prompt_ids):  # truncated: the rendered text no longer matches
        prompt_ids = outputs.prompt_token_ids

    role = state.args.response_role if req.add_generation_prompt else conversation[-1]["role"]
    echo_text = ""
    if req.echo and conversation[-1]["role"] == role and conversation[-1]["content"] is not None:
        echo_text = content_text(conversation[-1]["content"])
    job = _ChatJob(
        state,
        request_id,
        model,
        int(time.time()),
        role,
        echo_text,
        len(prompt_ids),
        params.n,
        top_logprobs,
        include_usage,
        continuous_usage,
        outputs,
        plan,
        prompt,
    )
    return await respond(request, stream, lambda emit: _stream(job, emit), lambda: _collect(job), deadline)


def _guided_decoding(req: ChatCompletionRequest, plan: ChatOutputPlan, prompt: str, state: ServerState):
    """The request's grammar: response_format / guided_* or the tool_choice grammar (not both); under a
    reasoning parser it starts after the end-of-reasoning marker."""
    guided = guided_decoding_from_request(req)
    if guided is not None and plan.tool_grammar is not None:
        raise bad_request('tool_choice "required" or a named function cannot be combined with '
                          "response_format or guided decoding", param="tool_choice")
    guided = guided or plan.tool_grammar
    if guided is not None and plan.grammar_waits_for_reasoning(prompt):
        marker = state.tokenizer.encode(plan.reasoning_end_marker(), add_special_tokens=False)
        guided = msgspec.structs.replace(guided, reasoning_end_token_ids=marker)
    return guided


async def _collect(job: _ChatJob) -> ChatCompletionResponse:
    state = job.state
    texts: dict[int, list[str]] = {}
    token_ids: dict[int, list[int]] = {}
    positions: dict[int, list[Any]] = {}
    finish: dict[int, tuple[str | None, Any]] = {}
    done = False
    try:
        async for out in job.outputs:
            job.num_cached = out.num_cached_tokens
            for c in out.outputs:
                texts.setdefault(c.index, []).append(c.text)
                token_ids.setdefault(c.index, []).extend(c.token_ids)
                if c.logprobs:
                    positions.setdefault(c.index, []).extend(c.logprobs)
                finish[c.index] = (c.finish_reason, c.stop_reason)
            if out.finished:
                done = True
                break
    except Exception as exc:
        raise engine_failure(exc) from exc
    finally:
        if not done:
            await state.abort(job.request_id)
    indices = sorted(texts)
    choices = []
    for i in indices:
        logprobs = None
        if job.top_logprobs is not None:
            logprobs = ChatLogprobs(
                content=chat_logprobs(state.decode_token, token_ids[i], positions.get(i), job.top_logprobs)
            )
        reason, stop_reason = finish[i]
        content = job.echo_text + "".join(texts[i])
        message = ChatResponseMessage(role=job.role, content=content)
        pipeline = job.plan.new_choice(job.prompt)
        if pipeline.active:
            reasoning, content, calls = pipeline.extract("".join(texts[i]))
            message = ChatResponseMessage(role=job.role, content=content, tool_calls=calls)
            if job.plan.reasoning_parser:
                message.reasoning_content = reasoning
            reason = pipeline.finish_reason(reason)
        choices.append(
            ChatChoice(
                index=i,
                message=message,
                logprobs=logprobs,
                finish_reason=reason,
                stop_reason=stop_reason,
            )
        )
    num_completion = sum(len(token_ids[i]) for i in indices)
    return reply_object(
        job, ChatCompletionResponse, choices, usage=usage(job.num_prompt_tokens, num_completion, job.num_cached_tokens)
    )


async def _stream(job: _ChatJob, emit: Emit) -> None:
    state = job.state

    def chunk(choices: list[ChatChunkChoice]) -> bytes:
        return chunk_event(job, ChatCompletionChunk, choices)

    done = False
    pipelines: dict[int, ChoiceOutput] = {}
    held_logprobs: dict[int, list[Any]] = {}  # per choice: logprobs of a feed that gave no chunk
    # The role chunks (and the echo) go out with the first token, as vLLM sends them: a client timing
    # its first chunk measures the real TTFT, and a request timing out before its first token is a 504.
    opening = [
        chunk([ChatChunkChoice(index=i, delta=DeltaMessage(role=job.role, content=""))])
        for i in range(job.n)
    ]
    if job.echo_text:
        opening += [
            chunk([ChatChunkChoice(index=i, delta=DeltaMessage(content=job.echo_text))])
            for i in range(job.n)
        ]
    try:
        async for out in job.outputs:
            job.num_cached = out.num_cached_tokens
            events = []
            for c in out.outputs:
                job.num_completion_tokens += len(c.token_ids)
                if not c.text and not c.token_ids and c.finish_reason is None:
                    continue
                logprobs = None
                if job.top_logprobs is not None and c.token_ids:
                    logprobs = ChatLogprobs(
                        content=chat_logprobs(state.decode_token, c.token_ids, c.logprobs, job.top_logprobs)
                    )
                finished = c.finish_reason is not None
                pipeline = pipelines.get(c.index) or pipelines.setdefault(c.index, job.plan.new_choice(job.prompt))
                if pipeline.active:
                    parts = pipeline.feed(c.text) + (pipeline.finish() if finished else [])
                    if c.index in held_logprobs:  # logprobs of text the parsers held back come first
                        earlier = held_logprobs.pop(c.index)
                        logprobs = ChatLogprobs(content=earlier + (logprobs.content if logprobs else []))
                    if not parts and not finished:
                        if logprobs is not None:
                            held_logprobs[c.index] = logprobs.content
                        continue
                    for k, part in enumerate(parts):
                        last = finished and k == len(parts) - 1
                        events.append(chunk([ChatChunkChoice(
                            index=c.index, delta=DeltaMessage(**part), logprobs=logprobs if k == 0 else None,
                            finish_reason=pipeline.finish_reason(c.finish_reason) if last else None,
                            stop_reason=c.stop_reason if last else UNSET)]))
                    if finished and not parts:
                        events.append(chunk([ChatChunkChoice(
                            index=c.index, delta=DeltaMessage(), logprobs=logprobs,
                            finish_reason=pipeline.finish_reason(c.finish_reason), stop_reason=c.stop_reason)]))
                    continue
                events.append(
                    chunk(
                        [
                            ChatChunkChoice(
                                index=c.index,
                                delta=DeltaMessage(content=c.text),
                                logprobs=logprobs,
                                finish_reason=c.finish_reason,
                                stop_reason=c.stop_reason if finished else UNSET,
                            )
                        ]
                    )
                )
            if out.finished:
                done = True
            if opening and (events or done):
                events, opening = opening + events, []
            if events:
                await emit(b"".join(events))
            if done:
                break
        await emit(b"".join(opening) + end_events(job, ChatCompletionChunk))
    except Exception as exc:
        logger.exception("chat request %s failed while streaming", job.request_id)
        await emit(failure_events(exc))
    finally:
        if not done:
            await state.abort(job.request_id)
