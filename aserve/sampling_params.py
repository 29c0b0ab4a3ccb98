"""SamplingParams: vLLM's names and defaults, validated once at intake (errors name the field)."""

from __future__ import annotations

from enum import IntEnum
from typing import Any, Callable

import msgspec

_SAMPLING_EPS = 1e-5


class RequestOutputKind(IntEnum):
    CUMULATIVE = 0  # every output holds everything so far
    DELTA = 1  # every output holds only what is new
    FINAL_ONLY = 2  # one output when the request finishes


class SamplingParamsError(ValueError):
    """An invalid sampling parameter; `field` names it (the server maps this to a 400 with `param`)."""

    def __init__(self, field: str, message: str):
        super().__init__(f"{field}: {message}")
        self.field = field


def _check(ok: bool, field: str, message: str) -> None:
    if not ok:
        raise SamplingParamsError(field, message)


class SamplingParams(msgspec.Struct, kw_only=True, omit_defaults=True):
    """How to sample one request. Mirrors vLLM's `SamplingParams`.

    `logits_processors` are callables `f(output_token_ids, logits) -> logits` or
    `f(prompt_token_ids, output_token_ids, logits) -> logits`; they only work with the in-process
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

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        if self.top_k == 0:
            self.top_k = -1  # 0 means "disabled", as in vLLM / OpenAI clients
        if self.logit_bias is not None:
            self.logit_bias = {int(k): float(v) for k, v in self.logit_bias.items()}
        self.validate()
        if self.temperature < _SAMPLING_EPS:
            # Greedy: the filters have no effect, keep them neutral so the sampler can batch.
            self.top_p, self.top_k, self.min_p = 1.0, -1, 0.0

    def validate(self) -> None:
        _check(isinstance(self.n, int) and self.n >= 1, "n", f"must be at least 1, got {self.n}")
        if self.best_of is not None:
            _check(self.best_of >= self.n, "best_of", f"must be >= n ({self.n}), got {self.best_of}")
        _check(-2.0 <= self.presence_penalty <= 2.0, "presence_penalty",
               f"must be in [-2, 2], got {self.presence_penalty}")
        _check(-2.0 <= self.frequency_penalty <= 2.0, "frequency_penalty",
               f"must be in [-2, 2], got {self.frequency_penalty}")
        _check(self.repetition_penalty > 0.0, "repetition_penalty",
               f"must be greater than zero, got {self.repetition_penalty}")
        _check(self.temperature >= 0.0, "temperature", f"must be non-negative, got {self.temperature}")
        _check(0.0 < self.top_p <= 1.0, "top_p", f"must be in (0, 1], got {self.top_p}")
        _check(self.top_k == -1 or self.top_k >= 1, "top_k", f"must be -1 (disable) or at least 1, got {self.top_k}")
        _check(0.0 <= self.min_p <= 1.0, "min_p", f"must be in [0, 1], got {self.min_p}")
        _check(self.max_tokens is None or self.max_tokens >= 1, "max_tokens",
               f"must be at least 1, got {self.max_tokens}")
        _check(self.min_tokens >= 0, "min_tokens", f"must be non-negative, got {self.min_tokens}")
        if self.max_tokens is not None:
            _check(self.min_tokens <= self.max_tokens, "min_tokens",
                   f"must be less than or equal to max_tokens={self.max_tokens}, got {self.min_tokens}")
        _check(self.logprobs is None or self.logprobs >= 0, "logprobs", f"must be non-negative, got {self.logprobs}")
        _check(self.prompt_logprobs is None or self.prompt_logprobs >= 0, "prompt_logprobs",
               f"must be non-negative, got {self.prompt_logprobs}")
        _check(self.truncate_prompt_tokens is None or self.truncate_prompt_tokens >= 1, "truncate_prompt_tokens",
               f"must be >= 1, got {self.truncate_prompt_tokens}")
        if self.stop is not None:
            _check(all(isinstance(s, str) for s in self.stop), "stop", "must be a string or a list of strings")
            _check(all(len(s) > 0 for s in self.stop), "stop", "must not contain empty strings")
            _check(self.detokenize, "stop", "stop strings need detokenize=True")
        if self.stop_token_ids is not None:
            _check(all(isinstance(t, int) and t >= 0 for t in self.stop_token_ids), "stop_token_ids",
                   "must be a list of non-negative integers")
        if self.allowed_token_ids is not None:
            _check(len(self.allowed_token_ids) > 0, "allowed_token_ids", "must not be empty")
        if self.logit_bias is not None:
            for v in self.logit_bias.values():
                _check(-100.0 <= v <= 100.0, "logit_bias", f"values must be in [-100, 100], got {v}")
        if self.logits_processors is not None:
            _check(all(callable(f) for f in self.logits_processors), "logits_processors", "must be callables")

    def validate_for_model(self, vocab_size: int, max_logprobs: int) -> None:
        """Checks that need the model: token ids in range, logprob counts within `max_logprobs`."""
        for name, ids in (("stop_token_ids", self.stop_token_ids), ("allowed_token_ids", self.allowed_token_ids),
                          ("logit_bias", list(self.logit_bias or ()))):
            bad = [t for t in ids or () if not 0 <= t < vocab_size]
            _check(not bad, name, f"token id(s) {bad[:5]} out of range [0, {vocab_size})")
        for name, value in (("logprobs", self.logprobs), ("prompt_logprobs", self.prompt_logprobs)):
            _check(value is None or value <= max_logprobs, name,
                   f"requested {value} but at most {max_logprobs} are allowed (--max-logprobs)")

    @property
    def sampling_type_greedy(self) -> bool:
        return self.temperature < _SAMPLING_EPS

    @property
    def num_samples(self) -> int:
        """How many sequences are generated (best_of of them are generated, n returned)."""
        return self.best_of or self.n

    def clone(self, **changes: Any) -> SamplingParams:
        return msgspec.structs.replace(self, **changes)

    def for_runner(self) -> SamplingParams:
        """A copy without callables, safe to encode with msgpack for a worker process."""
        return msgspec.structs.replace(self, logits_processors=None)


LogitsProcessor = Callable[..., Any]
