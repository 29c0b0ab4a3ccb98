"""Pooling request intake: tokenize (text, or a text pair for a cross-encoder), truncate, and check a
request's `PoolingParams` against the served model. The one place a pooling request is validated;
errors are `SamplingParamsError(field, message)` naming the field (the server answers 400):

- `task`: must be what the engine serves (`classify` and `score` name the same classifier);
- `dimensions`: only for Matryoshka models (config.json `is_matryoshka` / `matryoshka_dimensions`),
  at most the hidden size (and one of the listed sizes when the model lists them);
- `normalize` applies to embeddings, `activation` to a classifier's outputs;
- the prompt: at least one token, at most `max_model_len` (code "context_length_exceeded") after
  `truncate_prompt_tokens` (-1: `max_model_len`); token ids in [0, vocab_size).
"""

from __future__ import annotations

from typing import Any

import msgspec

from aserve.config import AserveConfig
from aserve.core.request import Request
from aserve.pooling_params import PoolingParams
from aserve.sampling_params import SamplingParams, SamplingParamsError, show

_UNUSED_SAMPLING = SamplingParams(max_tokens=1)  # a pooling request never samples
TextPair = tuple[str, str]


def _fail(field: str, message: str, code: str = "invalid_value") -> None:
    raise SamplingParamsError(field, message, code)


class PoolingInputProcessor:
    def __init__(self, config: AserveConfig, tokenizer):
        assert config.pooling is not None
        self.pooling = config.pooling
        self.tokenizer = tokenizer
        self.max_model_len = config.model.max_model_len
        self.vocab_size = config.model.arch.vocab_size
        self.hidden_size = config.model.arch.hidden_size

    def check_params(self, params: PoolingParams) -> PoolingParams:
        """`params` checked against the served model (see the module docstring), with the task set."""
        served = self.pooling.task
        task = params.task or served
        same = task == served or {task, served} == {"classify", "score"}
        if not same:
            _fail("task", f"this model serves --task {served}, not {task!r}")
        if params.dimensions is not None:
            if not self.pooling.is_matryoshka:
                _fail("dimensions", "this model does not support Matryoshka representation (config.json sets "
                      "no is_matryoshka / matryoshka_dimensions), so embeddings cannot be shortened")
            allowed = self.pooling.matryoshka_dimensions
            if params.dimensions > self.hidden_size or (allowed and params.dimensions not in allowed):
                _fail("dimensions", f"must be one of {list(allowed)}" if allowed else
                      f"must be at most the model's {self.hidden_size}, got {show(params.dimensions)}")
        if params.normalize is not None and self.pooling.is_classifier:
            _fail("normalize", "applies to embeddings; a classifier's outputs take `activation`")
        if params.activation is not None and not self.pooling.is_classifier:
            _fail("activation", "applies to a classifier's outputs (--task classify / score), not embeddings")
        t = params.truncate_prompt_tokens
        if t is not None and t > self.max_model_len:
            _fail("truncate_prompt_tokens", f"must be at most max_model_len ({self.max_model_len}), got {show(t)}")
        return params if params.task == task else msgspec.structs.replace(params, task=task)

    def process(self, prompt: str | TextPair | None, prompt_token_ids: Any,
                params: PoolingParams) -> tuple[list[int], PoolingParams]:
        """The prompt's token ids (truncated, checked) and the checked params; for a text pair the
        params carry its token type ids. `prompt_token_ids` win over `prompt`."""
        params = self.check_params(params)
        limit = self.max_model_len if params.truncate_prompt_tokens == -1 else params.truncate_prompt_tokens
        if prompt_token_ids is None:
            if prompt is None:
                _fail("prompt", "a prompt (text or token ids) is required")
            prompt_token_ids, token_types = self._tokenize(prompt, limit)
            if token_types is not None and any(token_types):
                params = msgspec.structs.replace(params, token_type_ids=token_types)
        elif not isinstance(prompt_token_ids, list | tuple):
            _fail("prompt", f"token ids must be a list, got {type(prompt_token_ids).__name__}")
        elif limit is not None:
            prompt_token_ids = list(prompt_token_ids)[-limit:]
        ids = list(prompt_token_ids)
        if not ids:
            _fail("prompt", "the input must not be empty")
        if len(ids) > self.max_model_len:
            _fail("prompt", f"this model's maximum context length is {self.max_model_len} tokens (max_model_len), "
                  f"but the input has {len(ids)} tokens; shorten it or set truncate_prompt_tokens",
                  "context_length_exceeded")
        vocab = self.vocab_size
        if not all(isinstance(t, int) and not isinstance(t, bool) and 0 <= t < vocab for t in ids):
            bad = [show(t) for t in ids if not (isinstance(t, int) and not isinstance(t, bool) and 0 <= t < vocab)]
            _fail("prompt", f"token ids must be integers in [0, {vocab}), got {bad[:5]}")
        return ids, params

    def _tokenize(self, prompt: str | TextPair, limit: int | None) -> tuple[list[int], list[int] | None]:
        if self.tokenizer is None:
            _fail("prompt", "text inputs need a tokenizer (the server runs with --skip-tokenizer-init); "
                  "send token ids instead")
        pair = isinstance(prompt, tuple)
        if pair and not (len(prompt) == 2 and all(isinstance(p, str) for p in prompt)):
            _fail("prompt", "a text pair must be two strings")
        if not pair and not isinstance(prompt, str):
            _fail("prompt", f"must be a string or a list of token ids, got {type(prompt).__name__}")
        texts = prompt if pair else (prompt,)
        kwargs: dict[str, Any] = {"add_special_tokens": True}
        if limit is not None:
            kwargs.update(truncation=True, max_length=limit)
        encoded = self.tokenizer(*texts, **kwargs)
        return list(encoded["input_ids"]), encoded.get("token_type_ids") if pair else None

    def make_request(self, request_id: str, token_ids: list[int], params: PoolingParams, arrival_time: float,
                     priority: int = 0, client_id: str | None = None) -> Request:
        return Request(request_id, token_ids, _UNUSED_SAMPLING, arrival_time=arrival_time, priority=priority,
                       client_id=client_id, pooling_params=params)
