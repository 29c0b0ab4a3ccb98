"""Grammar-constrained decoding in the runner (structured outputs).

One grammar state per guided request (`GuidedRequest`), built when the request arrives (a resumed
request replays its outputs into a fresh state, so preemption needs no rollback). Per step:

    future = outputs.start_fill(sample_req_ids)   # before the forward pass: one batched fill on a
    ...forward pass...                            # helper thread (xgrammar releases the GIL)
    mask = outputs.finish_fill(future)            # (bitmask, rows) for the sampler, or None
    ...sample (the sampler applies the mask after penalties, before temperature)...
    failed = outputs.accept(sample_req_ids, sampled_token_ids)

The tokenizer and the compilers are loaded on the first guided request, so unguided serving pays
nothing. A request whose grammar carries `reasoning_end_token_ids` samples freely until its output
ends with them (`</think>`); the grammar applies from the next token on.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

from aserve.config import AserveConfig
from aserve.structured_outputs.params import GuidedDecodingParams


class GuidedRequest:
    """One request's grammar position; `active` once the grammar applies (after reasoning)."""

    __slots__ = ("active", "reasoning_end", "state", "tail")

    def __init__(self, state: Any, reasoning_end: list[int] | None, active: bool, tail: list[int]):
        self.state = state
        self.reasoning_end = reasoning_end
        self.active = active
        self.tail = tail  # while reasoning: the last len(reasoning_end) output tokens

    def is_completed(self) -> bool:
        """True once the grammar is complete (only stop tokens allowed): min_tokens yields to it."""
        return self.active and self.state.is_completed()

    def advance_reasoning(self, token_id: int) -> None:
        marker = self.reasoning_end
        self.tail.append(int(token_id))
        del self.tail[:-len(marker)]
        if self.tail == marker:
            self.active = True


def _split_at_marker(outputs: list[int], marker: list[int]) -> int | None:
    """The index just past the first occurrence of `marker` in `outputs`, or None."""
    n = len(marker)
    for i in range(len(outputs) - n + 1):
        if outputs[i:i + n] == marker:
            return i + n
    return None


class StructuredOutputs:
    """The runner's guided requests, their compilers and the step's bitmask; one per runner."""

    def __init__(self, config: AserveConfig, max_num_rows: int):
        self._config = config
        self._max_num_rows = max_num_rows
        self._compilers = None
        self._builder = None
        self._pool: ThreadPoolExecutor | None = None
        self.requests: dict[str, GuidedRequest] = {}

    def _start(self) -> None:
        """Loads the tokenizer, the compilers and the bitmask builder (first guided request)."""
        from transformers import AutoTokenizer

        from aserve.structured_outputs.bitmask import BitmaskBuilder
        from aserve.structured_outputs.registry import StructuredOutputCompilers

        model = self._config.model
        if model.tokenizer_mode == "mistral":  # mistral_common's tokenizer (checked at start-up by the engine)
            from transformers.tokenization_mistral_common import MistralCommonBackend

            tokenizer = MistralCommonBackend.from_pretrained(model.tokenizer, revision=model.tokenizer_revision or "main",
                                                             local_files_only=os.path.isdir(model.tokenizer))
        else:
            tokenizer = AutoTokenizer.from_pretrained(model.tokenizer, revision=model.tokenizer_revision,
                                                      trust_remote_code=model.trust_remote_code)
        vocab = model.arch.vocab_size
        eos = list(model.arch.eos_token_ids) or None
        self._compilers = StructuredOutputCompilers(tokenizer, vocab, stop_token_ids=eos,
                                                    default_backend=self._config.structured_outputs)
        self._builder = BitmaskBuilder(vocab, self._max_num_rows,
                                       pin_memory=self._config.device.device == "cuda")
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="aserve-bitmask")

    def add(self, req_id: str, params: GuidedDecodingParams, output_token_ids: Sequence[int],
            stop_token_ids: Sequence[int]) -> GuidedRequest:
        """Builds the request's state, replaying `output_token_ids` (a resumed request). Raises
        (GrammarCompileError, GrammarStateError) leaving nothing behind; the runner fails the
        request alone. `stop_token_ids`: what ends the request (EOS unless ignore_eos, plus its
        stop_token_ids): the completed grammar allows exactly these."""
        if self._compilers is None:
            self._start()
        outputs = list(output_token_ids)
        marker = list(params.reasoning_end_token_ids) if params.reasoning_end_token_ids else None
        active, tail, replay = True, [], outputs
        if marker is not None:
            start = _split_at_marker(outputs, marker)
            active = start is not None
            replay = outputs[start:] if active else []
            tail = [] if active else outputs[-len(marker):]
        state = self._compilers.state_for(params, replay, list(stop_token_ids) or None)
        guided = self.requests[req_id] = GuidedRequest(state, marker, active, tail)
        return guided

    def remove(self, req_id: str) -> None:
        self.requests.pop(req_id, None)

    def start_fill(self, sample_req_ids: Sequence[str]) -> Future | None:
        """Starts filling the bitmask rows of the active guided requests among `sample_req_ids`
        (row i = sample_req_ids[i]) on the helper thread; None when no row is guided."""
        if not self.requests:
            return None
        rows, states = [], []
        for i, req_id in enumerate(sample_req_ids):
            guided = self.requests.get(req_id)
            if guided is not None and guided.active:
                rows.append(i)
                states.append(guided.state)
        if not rows:
            return None
        return self._pool.submit(self._fill, rows, states)

    def _fill(self, rows: list[int], states: list[Any]) -> tuple[Any, list[int]]:
        import torch

        with torch.inference_mode():  # the bitmask was made inside the runner's inference mode
            return self._builder.fill(rows, states), rows

    @staticmethod
    def finish_fill(future: Future | None) -> tuple[Any, list[int]] | None:
        """(bitmask, rows) once the fill is done; None if nothing was started."""
        return None if future is None else future.result()

    def accept(self, req_ids: Sequence[str], token_ids: Sequence[int]) -> dict[str, str]:
        """Advances each guided request with its sampled token; returns req_id -> why for those whose
        grammar rejected it (the runner fails them alone)."""
        if not self.requests:
            return {}
        from aserve.structured_outputs.bitmask import accept_tokens

        batch_ids, batch_states, batch_tokens = [], [], []
        for req_id, token in zip(req_ids, token_ids):
            guided = self.requests.get(req_id)
            if guided is None:
                continue
            if not guided.active:
                guided.advance_reasoning(token)
            elif not guided.state.is_terminated():
                batch_ids.append(req_id)
                batch_states.append(guided.state)
                batch_tokens.append(token)
        failed = {}
        if batch_states:
            for req_id, token, ok in zip(batch_ids, batch_tokens, accept_tokens(batch_states, batch_tokens)):
                if not ok:
                    failed[req_id] = (f"the sampled token {token} is not allowed by the request's grammar "
                                      "(guided decoding left no allowed token)")
        return failed
