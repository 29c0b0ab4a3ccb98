"""Request fields -> SamplingParams, and logprob formatting (shared by handlers).

Nothing here validates values: SamplingParams and the engine's intake do, raising
SamplingParamsError; the handlers map its field to the request's (`errors.sampling_errors_as_400`).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import msgspec

from aserve.outputs import Logprob
from aserve.sampling_params import RequestOutputKind, SamplingParams, SamplingParamsError
from aserve.structured_outputs.params import GuidedDecodingParams
from aserve.server.errors import bad_request
from aserve.server.logits_processors import resolve_logits_processors
from aserve.server.protocol import (
    ChatLogprobEntry,
    ChatTopLogprob,
    CompletionLogprobs,
    PromptTokensDetails,
    UsageInfo,
)

_MIN_LOGPROB = -9999.0  # JSON has no -inf


def default_max_tokens(
    defaults: dict[str, Any], num_prompt_tokens: int, truncate_prompt_tokens: Any, max_model_len: int
) -> int:
    """max_tokens for a request that sets none: the room the prompt leaves in the context, or the
    model's default (generation_config.json) if smaller. Validates nothing (a prompt that leaves no
    room is refused at intake)."""
    if isinstance(truncate_prompt_tokens, int) and truncate_prompt_tokens >= 1:
        num_prompt_tokens = min(num_prompt_tokens, truncate_prompt_tokens)
    room = max(1, max_model_len - num_prompt_tokens)
    default = defaults.get("max_tokens")
    return room if default is None else max(1, min(default, room))


def build_sampling_params(
    req: Any,
    *,
    max_tokens: int | None,
    logprobs: int | None,
    stream: bool,
    best_of: int | None = None,
    prompt_logprobs: int | None = None,
    defaults: dict[str, Any] | None = None,
    guided_decoding: GuidedDecodingParams | None = None,
    logits_processor_pattern: str | None = None,
) -> SamplingParams:
    """SamplingParams from a chat/completions request. Raises SamplingParamsError naming the field
    (the caller maps it to the request's field names).

    Fields the request leaves unset take the model's `defaults` (generation_config.json), then
    OpenAI's.
    """
    stop = req.stop
    if isinstance(stop, str):
        stop = [stop]
    defaults = defaults or {}

    def pick(name: str, fallback: Any) -> Any:
        value = getattr(req, name)
        return value if value is not None else defaults.get(name, fallback)

    return SamplingParams(
        n=1 if req.n is None else req.n,
        best_of=best_of,
        presence_penalty=0.0 if req.presence_penalty is None else req.presence_penalty,
        frequency_penalty=0.0 if req.frequency_penalty is None else req.frequency_penalty,
        repetition_penalty=pick("repetition_penalty", 1.0),
        temperature=pick("temperature", 1.0),
        top_p=pick("top_p", 1.0),
        top_k=pick("top_k", -1),
        min_p=pick("min_p", 0.0),
        seed=req.seed,
        stop=stop or None,
        stop_token_ids=req.stop_token_ids,
        ignore_eos=req.ignore_eos,
        max_tokens=max_tokens,
        min_tokens=req.min_tokens,
        logprobs=logprobs,
        prompt_logprobs=prompt_logprobs,
        skip_special_tokens=req.skip_special_tokens,
        spaces_between_special_tokens=req.spaces_between_special_tokens,
        include_stop_str_in_output=req.include_stop_str_in_output,
        logit_bias=req.logit_bias,
        truncate_prompt_tokens=req.truncate_prompt_tokens,
        output_kind=RequestOutputKind.DELTA if stream else RequestOutputKind.FINAL_ONLY,
        guided_decoding=guided_decoding,
        logits_processors=resolve_logits_processors(req.logits_processors, logits_processor_pattern),
    )


def check_stream_options(req: Any) -> tuple[bool, bool]:
    """(include_usage, continuous_usage_stats); stream_options without stream is a 400."""
    opts = req.stream_options
    if opts is None:
        return False, False
    if not req.stream:
        raise bad_request("stream_options is only allowed when stream is true", param="stream_options")
    include = bool(opts.include_usage)
    return include, include and bool(opts.continuous_usage_stats)


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int | None = None) -> UsageInfo:
    """`cached_tokens` None: no `prompt_tokens_details` (the server runs without
    --enable-prompt-tokens-details)."""
    return UsageInfo(
        prompt_tokens=prompt_tokens,
        completion_tokens=completion_tokens,
        total_tokens=prompt_tokens + completion_tokens,
        prompt_tokens_details=msgspec.UNSET if cached_tokens is None else PromptTokensDetails(cached_tokens=cached_tokens),
    )


# -- logprobs --------------------------------------------------------------------------------------

Decode = Callable[[int], str]


def _clamp(value: float) -> float:
    return max(value, _MIN_LOGPROB)


def _text(decode: Decode, token_id: int, lp: Logprob | None) -> str:
    if lp is not None and lp.decoded_token is not None:
        return lp.decoded_token
    return decode(token_id)


def _top(candidates: dict[int, Logprob], top_n: int) -> list[tuple[int, Logprob]]:
    if top_n <= 0:
        return []
    ranked = sorted(
        candidates.items(), key=lambda kv: (kv[1].rank if kv[1].rank is not None else 1 << 30, -kv[1].logprob)
    )
    if all(lp.rank is not None for _, lp in ranked):
        ranked = [kv for kv in ranked if kv[1].rank <= top_n]  # type: ignore[operator]
    return ranked[:top_n]


def chat_logprobs(
    decode: Decode, token_ids: list[int], positions: list[dict[int, Logprob]] | None, top_n: int
) -> list[ChatLogprobEntry]:
    """OpenAI chat `logprobs.content` entries for the sampled `token_ids`."""
    entries: list[ChatLogprobEntry] = []
    for i, token_id in enumerate(token_ids):
        candidates = positions[i] if positions is not None and i < len(positions) else {}
        sampled = candidates.get(token_id)
        text = _text(decode, token_id, sampled)
        tops = []
        for tid, lp in _top(candidates, top_n):
            t = _text(decode, tid, lp)
            tops.append(ChatTopLogprob(token=t, logprob=_clamp(lp.logprob), bytes=list(t.encode("utf-8"))))
        entries.append(
            ChatLogprobEntry(
                token=text,
                logprob=_clamp(sampled.logprob) if sampled else _MIN_LOGPROB,
                bytes=list(text.encode("utf-8")),
                top_logprobs=tops,
            )
        )
    return entries


def append_completion_logprobs(
    out: CompletionLogprobs,
    decode: Decode,
    token_ids: list[int],
    positions: list[dict[int, Logprob] | None] | None,
    top_n: int,
    offset: int,
) -> int:
    """Append the completions-API logprobs of `token_ids` to `out`; returns the next text offset.

    A position whose entry is None (the first prompt token) gets `None` logprobs.
    """
    for i, token_id in enumerate(token_ids):
        candidates = positions[i] if positions is not None and i < len(positions) else None
        sampled = candidates.get(token_id) if candidates else None
        text = _text(decode, token_id, sampled)
        out.tokens.append(text)
        out.text_offset.append(offset)
        offset += len(text)
        if candidates is None:
            out.token_logprobs.append(None)
            out.top_logprobs.append(None)
            continue
        out.token_logprobs.append(_clamp(sampled.logprob) if sampled else None)
        tops = {_text(decode, tid, lp): _clamp(lp.logprob) for tid, lp in _top(candidates, top_n)}
        if sampled is not None:
            tops.setdefault(text, _clamp(sampled.logprob))  # OpenAI includes the sampled token
        out.top_logprobs.append(tops)
    return offset


def prompt_logprobs_dicts(
    decode: Decode, prompt_token_ids: list[int], positions: list[dict[int, Logprob] | None] | None, top_n: int
) -> list[dict[str, float] | None]:
    """vLLM's `prompt_logprobs` field: per prompt token, decoded token -> logprob (None for the first)."""
    out: list[dict[str, float] | None] = []
    for i, token_id in enumerate(prompt_token_ids):
        candidates = positions[i] if positions is not None and i < len(positions) else None
        if not candidates:
            out.append(None)
            continue
        entry = {_text(decode, tid, lp): _clamp(lp.logprob) for tid, lp in _top(candidates, top_n)}
        sampled = candidates.get(token_id)
        if sampled is not None:
            entry.setdefault(_text(decode, token_id, sampled), _clamp(sampled.logprob))
        out.append(entry)
    return out


# -- structured outputs ------------------------------------------------------------------------------

_GUIDED_FIELDS = (("guided_json", "json"), ("guided_regex", "regex"), ("guided_choice", "choice"),
                  ("guided_grammar", "grammar"), ("structural_tag", "structural_tag"))


def guided_decoding_from_request(req: Any) -> GuidedDecodingParams | None:
    """The request's output constraint: `response_format` (json_object / json_schema), vLLM's
    `guided_*` fields and `structural_tag`, or `structured_outputs` (vLLM's newer object), with
    `guided_whitespace_pattern` / `guided_decoding_backend`. None when nothing constrains the output.
    Raises SamplingParamsError naming the field for a malformed one (compilation is checked at intake).
    """
    spec: dict[str, Any] = {}
    fmt = req.response_format
    if fmt is not None:
        kind = fmt.get("type") if isinstance(fmt, dict) else None
        if kind == "json_object":
            spec["json_object"] = True
        elif kind == "json_schema":
            body = fmt.get("json_schema")
            schema = body.get("schema") if isinstance(body, dict) else None
            if not isinstance(schema, dict):
                raise SamplingParamsError("response_format", "json_schema needs {json_schema: {name, schema}}")
            spec["json"] = schema
        elif kind != "text":
            raise SamplingParamsError("response_format", f"type must be text, json_object or json_schema, got {kind!r}")
    for field, kind in _GUIDED_FIELDS:
        value = getattr(req, field)
        if value is not None:
            spec[kind] = value
    if req.structured_outputs is not None:
        so = dict(req.structured_outputs)
        if "json" in so or "regex" in so or "choice" in so or "grammar" in so or "structural_tag" in so or \
                "json_object" in so:
            spec.update(so)
        else:
            raise SamplingParamsError("structured_outputs", "needs one of json, regex, choice, grammar, "
                                                            "json_object, structural_tag")
    if not spec:
        return None
    kinds = [k for k in ("json", "regex", "choice", "grammar", "json_object", "structural_tag") if k in spec]
    if len(kinds) > 1:
        raise SamplingParamsError("response_format", "only one output constraint may be given, got "
                                  + ", ".join(kinds))
    if req.guided_whitespace_pattern is not None:
        spec["whitespace_pattern"] = req.guided_whitespace_pattern
    if req.guided_decoding_backend is not None:
        spec["backend"] = req.guided_decoding_backend
    try:
        return msgspec.convert(spec, GuidedDecodingParams)
    except msgspec.ValidationError as exc:
        raise SamplingParamsError("structured_outputs", str(exc)) from None
