"""Request intake: tokenize, truncate, validate against the model, fan n samples out into requests.

This is the one place a request is checked against the model; `SamplingParams` checks each field on
its own when it is built. Both raise `SamplingParamsError(field, message)` naming the field in
SamplingParams' terms ("prompt" for the prompt); the server maps it to the OpenAI field. Inner layers
(scheduler, executor, runner, sampler) trust what passes here:

- prompt: token ids are ints in [0, vocab_size), at least 1 and fewer than `max_model_len` after
  `truncate_prompt_tokens` (code "context_length_exceeded" when too long); text needs a tokenizer;
- `max_tokens`: prompt + max_tokens <= max_model_len ("context_length_exceeded");
- `truncate_prompt_tokens` <= max_model_len; `top_k` <= vocab_size (or -1);
- token ids in `stop_token_ids`, `allowed_token_ids` (at most vocab_size of them) and `logit_bias`
  keys are in [0, vocab_size);
- `logprobs` and `prompt_logprobs` <= `--max-logprobs`;
- `stop` strings need a tokenizer (text is matched); `logits_processors` need the in-process executor;
- `guided_decoding` needs a tokenizer and must compile (`SpecChecker`, cached by spec; the server
  runs `check_guided_decoding` in a worker thread first, so the check here is a cache hit).
"""

from __future__ import annotations

from typing import Any

import msgspec

from aserve.config import AserveConfig
from aserve.core.request import Request
from aserve.lora.request import LoRARequest
from aserve.structured_outputs.params import GrammarCompileError
from aserve.structured_outputs.registry import SpecChecker
from aserve.sampling_params import INT64_MIN, SamplingParams, SamplingParamsError, show


def _derived_seed(seed: int, index: int) -> int:
    """Sample `index`'s seed: seed + index, wrapped into int64 as torch wraps seeds (mod 2^64)."""
    return (seed + index - INT64_MIN) % 2**64 + INT64_MIN


def _fail(field: str, message: str, code: str = "invalid_value") -> None:
    raise SamplingParamsError(field, message, code)


class InputProcessor:
    def __init__(self, config: AserveConfig, tokenizer, eos_token_ids: tuple[int, ...]):
        self.config = config
        self.tokenizer = tokenizer
        self.eos_token_ids = eos_token_ids
        self.max_model_len = config.model.max_model_len
        self.vocab_size = config.model.arch.vocab_size
        self.max_logprobs = config.model.max_logprobs
        self.in_process = config.parallel.distributed_executor_backend == "uni"
        self.spec_checker = SpecChecker(config.structured_outputs)

    def tokenize(self, prompt: str) -> list[int]:
        if self.tokenizer is None:
            _fail("prompt", "text prompts need a tokenizer (the server runs with --skip-tokenizer-init); "
                  "send token ids instead")
        if not isinstance(prompt, str):
            _fail("prompt", f"must be a string or a list of token ids, got {type(prompt).__name__}")
        return self.tokenizer.encode(prompt, add_special_tokens=True)

    def process_prompt(self, prompt: str | None, prompt_token_ids: list[int] | None,
                       params: SamplingParams) -> list[int]:
        """Validates `params` against the model and returns the prompt's token ids after truncation.

        `prompt_token_ids` win over `prompt` (then only used for display). Raises SamplingParamsError.
        """
        self.check_params(params)
        if prompt_token_ids is None:
            if prompt is None:
                _fail("prompt", "a prompt (text or token ids) is required")
            prompt_token_ids = self.tokenize(prompt)
        return self.check_prompt(prompt_token_ids, params)

    def check_params(self, params: SamplingParams) -> None:
        """The checks of `params` that need the model (see the module docstring)."""
        vocab = self.vocab_size
        if params.top_k > vocab:
            _fail("top_k", f"must be -1 (disable) or at most the vocabulary size {vocab}, got {show(params.top_k)}")
        if params.truncate_prompt_tokens is not None and params.truncate_prompt_tokens > self.max_model_len:
            _fail("truncate_prompt_tokens", f"must be at most max_model_len ({self.max_model_len}), "
                  f"got {show(params.truncate_prompt_tokens)}")
        if params.allowed_token_ids is not None and len(params.allowed_token_ids) > vocab:
            _fail("allowed_token_ids", f"must have at most {vocab} entries (the vocabulary size), "
                  f"got {len(params.allowed_token_ids)}")
        for name, ids in (("stop_token_ids", params.stop_token_ids), ("allowed_token_ids", params.allowed_token_ids),
                          ("logit_bias", params.logit_bias)):
            bad = [t for t in ids or () if t >= vocab]
            if bad:
                _fail(name, f"token id(s) {[show(t) for t in bad[:5]]} out of range [0, {vocab})")
        for name, value in (("logprobs", params.logprobs), ("prompt_logprobs", params.prompt_logprobs)):
            if value is not None and value > self.max_logprobs:
                _fail(name, f"requested {show(value)} but at most {self.max_logprobs} are allowed (--max-logprobs)")
        if params.stop and (self.tokenizer is None or not params.detokenize):
            _fail("stop", "stop strings need detokenized text (a tokenizer and detokenize=True); "
                  "use stop_token_ids instead")
        if params.logits_processors and not self.in_process:
            _fail("logits_processors", "need the in-process executor (--distributed-executor-backend uni)")
        if params.guided_decoding is not None:
            self.check_guided_decoding(params)

    def check_guided_decoding(self, params: SamplingParams) -> None:
        """SamplingParamsError naming the request field unless `params.guided_decoding` (if any)
        compiles. Blocking on a new spec (the first call imports the grammar backend): the server
        calls it in a worker thread before submitting; verdicts are cached by spec."""
        if params.guided_decoding is None:
            return
        if self.tokenizer is None:
            _fail("guided_decoding", "structured outputs need a tokenizer (the server runs with "
                  "--skip-tokenizer-init)")
        try:
            self.spec_checker.check(params.guided_decoding)
        except GrammarCompileError as e:
            _fail(e.field, e.message)

    def check_prompt(self, prompt_token_ids: Any, params: SamplingParams) -> list[int]:
        """The prompt's token ids after `truncate_prompt_tokens`, checked against the vocabulary and
        the context length (lengths first, so a huge prompt costs no per-token work)."""
        if not isinstance(prompt_token_ids, list | tuple):
            _fail("prompt", f"token ids must be a list, got {type(prompt_token_ids).__name__}")
        ids = list(prompt_token_ids)
        if params.truncate_prompt_tokens is not None and len(ids) > params.truncate_prompt_tokens:
            ids = ids[-params.truncate_prompt_tokens:]
        if not ids:
            _fail("prompt", "the prompt must not be empty")
        num_prompt, limit = len(ids), self.max_model_len
        if num_prompt >= limit:
            _fail("prompt", f"this model's maximum context length is {limit} tokens (max_model_len), but the "
                  f"prompt has {num_prompt} tokens, which leaves no room for a completion",
                  "context_length_exceeded")
        vocab = self.vocab_size
        if not all(isinstance(t, int) and not isinstance(t, bool) and 0 <= t < vocab for t in ids):
            bad = [show(t) for t in ids if not (isinstance(t, int) and not isinstance(t, bool) and 0 <= t < vocab)]
            _fail("prompt", f"token ids must be integers in [0, {vocab}), got {bad[:5]}")
        if params.max_tokens is not None and num_prompt + params.max_tokens > limit:
            _fail("max_tokens", f"this model's maximum context length is {limit} tokens (max_model_len); you "
                  f"requested {num_prompt + params.max_tokens} tokens ({num_prompt} in the prompt, "
                  f"{params.max_tokens} for the completion)", "context_length_exceeded")
        return ids

    def make_requests(self, sample_ids: list[str], prompt_token_ids: list[int], params: SamplingParams,
                      arrival_time: float, priority: int, client_id: str | None = None,
                      lora_request: LoRARequest | None = None) -> list[Request]:
        """One scheduler request per sample; samples after the first wait for the first's prompt and
        then share its prompt blocks by reference. `client_id` (who sent it) is for fair sharing."""
        num = len(sample_ids)
        # best_of ranks samples by cumulative logprob, so the runner must report sampled logprobs.
        needs_logprobs = params.num_samples > params.n and params.logprobs is None
        requests = []
        for i, sid in enumerate(sample_ids):
            changes = {}
            if num > 1:
                changes.update(n=1, best_of=None)
                if params.seed is not None:
                    changes["seed"] = _derived_seed(params.seed, i)
            if needs_logprobs:
                changes["logprobs"] = 0
            child = msgspec.structs.replace(params, **changes) if changes else params
            requests.append(Request(
                sid, prompt_token_ids, child, eos_token_ids=self.eos_token_ids, arrival_time=arrival_time,
                priority=priority, wait_for_req_id=sample_ids[0] if i > 0 else None,
                max_model_len=self.max_model_len, share_prefix=num > 1, client_id=client_id,
                lora_request=lora_request))
        return requests
