"""Request intake: tokenize, truncate, validate against the model, fan n samples out into requests.

Errors are raised once here (SamplingParamsError naming the field); inner layers trust their input.
"""

from __future__ import annotations

import msgspec

from aserve.config import AserveConfig
from aserve.core.request import Request
from aserve.sampling_params import SamplingParams, SamplingParamsError


class InputProcessor:
    def __init__(self, config: AserveConfig, tokenizer, eos_token_ids: tuple[int, ...]):
        self.config = config
        self.tokenizer = tokenizer
        self.eos_token_ids = eos_token_ids
        self.max_model_len = config.model.max_model_len
        self.in_process = config.parallel.distributed_executor_backend == "uni"

    def tokenize(self, prompt: str) -> list[int]:
        if self.tokenizer is None:
            raise SamplingParamsError("prompt", "text prompts need a tokenizer (skip_tokenizer_init is set)")
        return self.tokenizer.encode(prompt, add_special_tokens=True)

    def process_prompt(self, prompt: str | None, prompt_token_ids: list[int] | None,
                       params: SamplingParams, field: str = "prompt") -> list[int]:
        """Returns the prompt's token ids after truncation; validates params and lengths."""
        if prompt_token_ids is None:
            if prompt is None:
                raise SamplingParamsError(field, "a prompt (text or token ids) is required")
            prompt_token_ids = self.tokenize(prompt)
        else:
            prompt_token_ids = list(prompt_token_ids)
        vocab = self.config.model.arch.vocab_size
        if any(not (0 <= t < vocab) for t in prompt_token_ids):
            raise SamplingParamsError(field, f"token ids must be in [0, {vocab})")
        if params.truncate_prompt_tokens is not None and len(prompt_token_ids) > params.truncate_prompt_tokens:
            prompt_token_ids = prompt_token_ids[-params.truncate_prompt_tokens:]
        if not prompt_token_ids:
            raise SamplingParamsError(field, "the prompt must not be empty")
        params.validate_for_model(vocab, self.config.model.max_logprobs)
        if params.logits_processors and not self.in_process:
            raise SamplingParamsError("logits_processors", "need the in-process executor "
                                      "(--distributed-executor-backend uni)")
        n_prompt = len(prompt_token_ids)
        if n_prompt >= self.max_model_len:
            raise SamplingParamsError(field, f"this model's maximum context length is {self.max_model_len} tokens "
                                      f"(max_model_len), but the prompt has {n_prompt} tokens")
        if params.max_tokens is not None and n_prompt + params.max_tokens > self.max_model_len:
            raise SamplingParamsError(
                "max_tokens", f"this model's maximum context length is {self.max_model_len} tokens (max_model_len); "
                f"you requested {n_prompt + params.max_tokens} tokens ({n_prompt} in the prompt, "
                f"{params.max_tokens} for the completion)")
        return prompt_token_ids

    def make_requests(self, sample_ids: list[str], prompt_token_ids: list[int], params: SamplingParams,
                      arrival_time: float, priority: int) -> list[Request]:
        """One scheduler request per sample; samples after the first wait for the first's prompt and
        then share its prompt blocks by reference."""
        num = len(sample_ids)
        # best_of ranks samples by cumulative logprob, so the runner must report sampled logprobs.
        needs_logprobs = params.num_samples > params.n and params.logprobs is None
        requests = []
        for i, sid in enumerate(sample_ids):
            changes = {}
            if num > 1:
                changes.update(n=1, best_of=None)
                if params.seed is not None:
                    changes["seed"] = params.seed + i
            if needs_logprobs:
                changes["logprobs"] = 0
            child = msgspec.structs.replace(params, **changes) if changes else params
            requests.append(Request(
                sid, prompt_token_ids, child, eos_token_ids=self.eos_token_ids, arrival_time=arrival_time,
                priority=priority, wait_for_req_id=sample_ids[0] if i > 0 else None,
                max_model_len=self.max_model_len, share_prefix=num > 1))
        return requests
