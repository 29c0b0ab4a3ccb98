"""SamplingParams: vLLM's names and defaults, validated once at intake (errors name the field).

This module also holds the request limits (`MAX_*`, and `LIMITS`: each field's range and meaning):
every cap a request is checked against is defined here, once, and listed in the README's "Request
limits" table. `LIMITS` feeds both `SamplingParams.validate` and the field annotations in
`aserve.server.protocol`, from which `/openapi.json` shows each field's description, `minimum` and
`maximum` (schema only: decoding does not enforce them, so errors keep naming the field in OpenAI's
format). Field-level checks live in
`SamplingParams.validate`; the checks that need the model (vocabulary, `max_model_len`,
`--max-logprobs`, the prompt) live in `aserve.engine.input_processor`.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from enum import IntEnum
from typing import Any

import msgspec

from aserve.structured_outputs.params import GuidedDecodingParams

_SAMPLING_EPS = 1e-5

# -- request limits (the README's "Request limits" table lists each one) ----------------------------
INT64_MIN = -(2**63)
INT64_MAX = 2**63 - 1
MAX_N = 128  # n and best_of: samples per request (OpenAI's limit for n)
MAX_PROMPTS = 256  # prompts in one /v1/completions request (a list of strings or of token-id lists)
MAX_STOP_STRINGS = 64  # entries in `stop`
MAX_STOP_STRING_CHARS = 1024  # characters per stop string
MAX_STOP_TOKEN_IDS = 1024  # entries in `stop_token_ids`
MAX_LOGIT_BIAS_ENTRIES = 1024  # entries in `logit_bias`
LOGIT_BIAS_RANGE = (-100.0, 100.0)  # OpenAI's
PENALTY_RANGE = (-2.0, 2.0)  # presence_penalty and frequency_penalty (OpenAI's)
MAX_REPETITION_PENALTY = 100.0  # logits * 100 stays finite even in fp16
MAX_TEMPERATURE = 100.0  # far past uniform sampling; keeps logits / temperature well scaled
MAX_JSON_DEPTH = 64  # nesting of arrays/objects in a request body (checked by the HTTP layer)
# Seeds: any int64, as vLLM (torch.long). The runner derives seed + sample index and seed + tokens
# generated so far, which stays inside what torch's manual_seed takes ([-2^63, 2^64)).


@dataclass(frozen=True)
class Limit:
    """One request field's accepted range and meaning: what validation checks and /openapi.json shows.

    `low`/`high` bound a number (`open_low`: `low` itself is refused); `schema` holds further JSON
    Schema keywords (sizes of lists and maps, ranges of their entries). None: no bound.
    """

    description: str
    low: int | float | None = None
    high: int | float | None = None
    open_low: bool = False
    schema: dict[str, Any] = field(default_factory=dict)

    def json_schema(self) -> dict[str, Any]:
        """The JSON Schema keywords for this range (to sit beside the field's type)."""
        out = dict(self.schema)
        if self.low is not None:
            out["exclusiveMinimum" if self.open_low else "minimum"] = self.low
        if self.high is not None:
            out["maximum"] = self.high
        return out


_MAX_LOGPROBS_NOTE = "; the server also caps it at `--max-logprobs` (default 20)"

LIMITS: dict[str, Limit] = {
    "n": Limit("How many completions to return for each prompt.", 1, MAX_N),
    "best_of": Limit(
        f"How many completions to generate, returning the `n` with the highest cumulative logprob; at "
        f"least `n`, at most {MAX_N}.", 1, MAX_N),
    "presence_penalty": Limit(
        "Penalizes tokens that already appear in the output (positive: less repetition).", *PENALTY_RANGE),
    "frequency_penalty": Limit(
        "Penalizes tokens by how often they already appear in the output (positive: less repetition).",
        *PENALTY_RANGE),
    "repetition_penalty": Limit(
        "Divides the positive (multiplies the negative) logits of tokens already in the prompt or output "
        "by this (vLLM's; 1: off, above 1: less repetition).",
        0.0, MAX_REPETITION_PENALTY, open_low=True),
    "temperature": Limit("Sampling temperature: 0 is greedy, higher is more random.", 0.0, MAX_TEMPERATURE),
    "top_p": Limit("Nucleus sampling: sample from the smallest set of tokens whose probabilities add up "
                   "to `top_p` (1: off).", 0.0, 1.0, open_low=True),
    "top_k": Limit("Sample from the `top_k` most likely tokens (vLLM's; -1 or 0: off; at most the "
                   "vocabulary size).", -1, INT64_MAX),
    "min_p": Limit("Drop tokens less likely than `min_p` times the most likely token (vLLM's; 0: off).",
                   0.0, 1.0),
    "seed": Limit("Seed for sampling (any int64; sample i of the request uses seed + i).", INT64_MIN, INT64_MAX),
    "max_tokens": Limit("The most tokens to generate; prompt + max_tokens must fit in the model's "
                        "context (`max_model_len`).", 1, INT64_MAX),
    "min_tokens": Limit("Generate at least this many tokens before EOS or a stop may end the output "
                        "(vLLM's; at most `max_tokens`).", 0, INT64_MAX),
    "logprobs": Limit("Return the log probabilities of this many most likely tokens at each position"
                      + _MAX_LOGPROBS_NOTE + ".", 0, INT64_MAX),
    "prompt_logprobs": Limit("Return the log probabilities of this many most likely tokens at each prompt "
                             "position (vLLM's)" + _MAX_LOGPROBS_NOTE + ".", 0, INT64_MAX),
    "truncate_prompt_tokens": Limit("Keep only the last this many prompt tokens (vLLM's; at most "
                                    "`max_model_len`).", 1, INT64_MAX),
    "priority": Limit("Scheduling priority with `--scheduling-policy priority` (lower is served first).",
                      INT64_MIN, INT64_MAX),
    "stop": Limit(f"Up to {MAX_STOP_STRINGS} strings (of at most {MAX_STOP_STRING_CHARS} characters) that "
                  "end the output (not returned unless `include_stop_str_in_output`).",
                  schema={"maxItems": MAX_STOP_STRINGS, "maxLength": MAX_STOP_STRING_CHARS,
                          "items": {"minLength": 1, "maxLength": MAX_STOP_STRING_CHARS}}),
    "stop_token_ids": Limit(f"Up to {MAX_STOP_TOKEN_IDS} token ids that end the output (vLLM's).",
                            schema={"maxItems": MAX_STOP_TOKEN_IDS, "items": {"minimum": 0}}),
    "logit_bias": Limit(
        f"Up to {MAX_LOGIT_BIAS_ENTRIES} entries token id -> bias in [{LOGIT_BIAS_RANGE[0]:g}, "
        f"{LOGIT_BIAS_RANGE[1]:g}], added to that token's logit.",
        schema={"maxProperties": MAX_LOGIT_BIAS_ENTRIES, "propertyNames": {"pattern": "^[0-9]{1,20}$"},
                "additionalProperties": {"minimum": LOGIT_BIAS_RANGE[0], "maximum": LOGIT_BIAS_RANGE[1]}}),
    "prompts": Limit(f"The prompt: a string, a list of token ids, or a list of up to {MAX_PROMPTS} "
                     "strings or token-id lists (one completion each).", schema={"maxItems": MAX_PROMPTS}),
}
"""Each limited request field (SamplingParams' names, plus `prompts`): its range and meaning."""


class RequestOutputKind(IntEnum):
    CUMULATIVE = 0  # every output holds everything so far
    DELTA = 1  # every output holds only what is new
    FINAL_ONLY = 2  # one output when the request finishes


class SamplingParamsError(ValueError):
    """An invalid request parameter. `field` names it in SamplingParams' terms ("prompt" for the
    prompt); `code` is OpenAI's error code ("invalid_value", or "context_length_exceeded").
    The server maps `field` to the OpenAI request's field name and answers 400."""

    def __init__(self, field: str, message: str, code: str = "invalid_value"):
        super().__init__(f"{field}: {message}")
        self.field = field
        self.message = message
        self.code = code


def _check(ok: bool, field: str, message: str) -> None:
    if not ok:
        raise SamplingParamsError(field, message)


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def show(value: Any) -> str:
    """`value` for an error message, short even for a huge integer or a long string."""
    if _is_int(value) and abs(value) > INT64_MAX:
        return f"an integer of {value.bit_length()} bits"
    text = repr(value)
    return text if len(text) <= 40 else text[:37] + "..."


def check_int(value: Any, field: str, low: int, high: int) -> None:
    """`value` is an int (not a bool) in [low, high]; SamplingParamsError naming `field` otherwise."""
    _check(_is_int(value), field, f"must be an integer, got {type(value).__name__}")
    _check(low <= value <= high, field, f"must be in [{low}, {high}], got {show(value)}")


def check_float(value: Any, field: str, low: float, high: float, *, open_low: bool = False) -> None:
    """`value` is a finite number in [low, high] ((low, high] with `open_low`)."""
    _check(_is_int(value) or isinstance(value, float), field, f"must be a number, got {type(value).__name__}")
    number = value if isinstance(value, float) or abs(value) <= INT64_MAX else math.inf  # no OverflowError
    _check(math.isfinite(number), field, f"must be a finite number, got {show(value)}")
    ok = (low < number if open_low else low <= number) and number <= high
    _check(ok, field, f"must be in {'(' if open_low else '['}{low}, {high}], got {show(value)}")


def check_limit(value: Any, name: str, *, low: float | None = None, high: float | None = None) -> None:
    """`value` within `LIMITS[name]` (an int when the bounds are ints); `low`/`high` override a bound
    that depends on another field (best_of >= n, min_tokens <= max_tokens)."""
    limit = LIMITS[name]
    low = limit.low if low is None else low
    high = limit.high if high is None else high
    if isinstance(limit.low, int):
        check_int(value, name, low, high)
    else:
        check_float(value, name, low, high, open_low=limit.open_low)


def check_token_ids(ids: Any, field: str, max_count: int) -> None:
    """A list of at most `max_count` non-negative int64 token ids (the vocabulary is checked at intake)."""
    _check(isinstance(ids, list), field, "must be a list of token ids")
    _check(len(ids) <= max_count, field, f"must have at most {max_count} entries, got {len(ids)}")
    for t in ids:
        check_int(t, field, 0, INT64_MAX)


class SamplingParams(msgspec.Struct, kw_only=True, omit_defaults=True):
    """How to sample one request. Mirrors vLLM's `SamplingParams`.

    Construction validates every field on its own (`validate`) and raises `SamplingParamsError`
    naming the first bad one. `logits_processors` are callables `f(output_token_ids, logits) -> logits`
    or `f(prompt_token_ids, output_token_ids, logits) -> logits`; they only work with the in-process
    (`uni`) executor, since callables cannot cross a process boundary.
    """

    n: int = 1
    best_of: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    min_p: float = 0.0
    seed: int | None = None
    stop: list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    max_tokens: int | None = 16
    min_tokens: int = 0
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    detokenize: bool = True
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    logit_bias: dict[int, float] | None = None
    allowed_token_ids: list[int] | None = None
    truncate_prompt_tokens: int | None = None
    output_kind: RequestOutputKind = RequestOutputKind.CUMULATIVE
    logits_processors: list[Any] | None = None
    # Grammar-constrained decoding (structured outputs); `structured_outputs` is vLLM's newer name
    # for the same field: construction moves it into `guided_decoding`.
    guided_decoding: GuidedDecodingParams | None = None
    structured_outputs: GuidedDecodingParams | None = None

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        if self.structured_outputs is not None:
            _check(self.guided_decoding is None or self.guided_decoding == self.structured_outputs,
                   "structured_outputs", "give either guided_decoding or structured_outputs, not both")
            self.guided_decoding, self.structured_outputs = self.structured_outputs, None
        self.validate()
        if self.top_k == 0:
            self.top_k = -1  # 0 means "disabled", as in vLLM / OpenAI clients
        if self.logit_bias is not None:
            self.logit_bias = {int(k): float(v) for k, v in self.logit_bias.items()}
        if self.temperature < _SAMPLING_EPS:
            # Greedy: the filters have no effect, keep them neutral so the sampler can batch.
            self.top_p, self.top_k, self.min_p = 1.0, -1, 0.0

    def validate(self) -> None:
        """Every field on its own: types, ranges, finiteness, the count caps (`MAX_*`)."""
        check_limit(self.n, "n")
        if self.best_of is not None:
            check_limit(self.best_of, "best_of", low=self.n)
        for name in ("presence_penalty", "frequency_penalty", "repetition_penalty", "temperature", "top_p"):
            check_limit(getattr(self, name), name)
        top_k = LIMITS["top_k"]
        _check(_is_int(self.top_k) and (self.top_k == top_k.low or 0 <= self.top_k <= top_k.high), "top_k",
               f"must be -1 or 0 (disable) or a positive int64, got {show(self.top_k)}")
        check_limit(self.min_p, "min_p")
        for name in ("seed", "max_tokens", "logprobs", "prompt_logprobs", "truncate_prompt_tokens"):
            if getattr(self, name) is not None:
                check_limit(getattr(self, name), name)
        check_limit(self.min_tokens, "min_tokens", high=self.max_tokens)
        self._validate_stop()
        if self.stop_token_ids is not None:
            check_token_ids(self.stop_token_ids, "stop_token_ids", MAX_STOP_TOKEN_IDS)
        if self.allowed_token_ids is not None:
            # The length cap (the vocabulary size) needs the model: checked at intake.
            _check(isinstance(self.allowed_token_ids, list) and len(self.allowed_token_ids) > 0,
                   "allowed_token_ids", "must be a non-empty list of token ids")
        self._validate_logit_bias()
        if self.logits_processors is not None:
            _check(all(callable(f) for f in self.logits_processors), "logits_processors", "must be callables")
        if self.guided_decoding is not None:
            _check(isinstance(self.guided_decoding, GuidedDecodingParams), "guided_decoding",
                   "must be GuidedDecodingParams (StructuredOutputsParams)")
            self.guided_decoding.validate()  # whether it compiles is checked at intake

    def _validate_stop(self) -> None:
        if self.stop is None:
            return
        _check(isinstance(self.stop, list) and all(isinstance(s, str) for s in self.stop), "stop",
               "must be a string or a list of strings")
        _check(len(self.stop) <= MAX_STOP_STRINGS, "stop",
               f"must have at most {MAX_STOP_STRINGS} entries, got {len(self.stop)}")
        _check(all(len(s) > 0 for s in self.stop), "stop", "must not contain empty strings")
        longest = max((len(s) for s in self.stop), default=0)
        _check(longest <= MAX_STOP_STRING_CHARS, "stop",
               f"each stop string must have at most {MAX_STOP_STRING_CHARS} characters, got {longest}")
        _check(self.detokenize, "stop", "stop strings need detokenize=True")

    def _validate_logit_bias(self) -> None:
        bias = self.logit_bias
        if bias is None:
            return
        _check(isinstance(bias, dict), "logit_bias", "must map token ids to biases")
        _check(len(bias) <= MAX_LOGIT_BIAS_ENTRIES, "logit_bias",
               f"must have at most {MAX_LOGIT_BIAS_ENTRIES} entries, got {len(bias)}")
        for key, value in bias.items():
            token_id = key
            if isinstance(key, str):  # JSON object keys are strings
                digits = key.removeprefix("-")
                _check(0 < len(digits) <= 20 and digits.isascii() and digits.isdigit(), "logit_bias",
                       f"keys must be token ids (integers), got {key[:30]!r}")
                token_id = int(key)
            check_int(token_id, "logit_bias", 0, INT64_MAX)
            check_float(value, "logit_bias", *LOGIT_BIAS_RANGE)

    @property
    def sampling_type_greedy(self) -> bool:
        return self.temperature < _SAMPLING_EPS

    @property
    def num_samples(self) -> int:
        """How many sequences are generated (best_of of them are generated, n returned)."""
        return self.best_of or self.n

    def clone(self, **changes: Any) -> SamplingParams:
        return msgspec.structs.replace(self, **changes)


LogitsProcessor = Callable[..., Any]
