"""Per-request sampling state, built once when a request arrives and kept until it leaves.

The numeric parameters of every live request (temperature, top_p, top_k, min_p, the three penalties)
are rows of one persistent host table (`SamplingStates`; numpy, where a row write costs about a
microsecond and a torch element write tens), written once in `add` and freed in `remove`; a step
gathers the rows it samples with one index and moves them to the device in one non-blocking copy.
What cannot be a table row stays on the request's `RequestSampling`: its generator, its logit-bias /
allowed-token tensors, its logits processors, and host-side flags that let a step skip the work no
row needs.

The runner trusts its input (intake validated every field); `add` raises only where building the
state itself fails (a generator torch will not seed, a logits processor whose signature cannot be
used), and then leaves no trace, so the caller can fail that request alone.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from aserve.runner.sampling.processors import processor_arity
from aserve.sampling_params import SamplingParams

# Columns of the per-request parameter table (float32; top_k is exact there for any vocabulary < 2**24).
TEMPERATURE, TOP_P, TOP_K, MIN_P, REPETITION, PRESENCE, FREQUENCY = range(7)
_NUM_COLUMNS = 7
_INITIAL_CAPACITY = 16


def make_generator(seed: int, device: torch.device | str) -> torch.Generator:
    """A generator for one seeded request (or the sampler's shared one)."""
    gen = torch.Generator(device=torch.device(device))
    gen.manual_seed(int(seed))
    return gen


def index_tensor(values: list[int], device: torch.device) -> torch.Tensor:
    """An int64 index on `device`, built on the host and copied without waiting for the device."""
    return torch.tensor(values, dtype=torch.int64).to(device, non_blocking=True)


@dataclass(eq=False)
class RequestSampling:
    """One request as the sampler sees it. `token_ids` is the runner's own list (prompt, then outputs),
    not a copy: the runner appends each sampled token to it, and the sampler reads outputs from it."""

    slot: int  # its row in SamplingStates
    token_ids: list[int]
    num_prompt_tokens: int
    greedy: bool
    top_k: int  # 0 = off (also when top_k >= vocab)
    top_p: float
    min_p: float
    scales_temperature: bool  # temperature != 1 on a random row
    repetition: bool  # repetition_penalty != 1
    presence_or_frequency: bool  # presence or frequency penalty != 0
    bias_ids: torch.Tensor | None
    bias_values: torch.Tensor | None
    allowed_ids: torch.Tensor | None
    min_tokens: int
    stop_token_ids_for_min_tokens: list[int]
    processors: list[tuple[Callable[..., Any], int]]  # (callable, number of positional args: 2 or 3)
    num_logprobs: int | None
    generator: torch.Generator | None  # set for seeded random rows; None draws from the shared one
    # The request's grammar (runner/structured.py GuidedRequest), None when unguided: set by the runner.
    grammar: Any = None
    _prompt_ids: torch.Tensor | None = field(default=None, repr=False)
    _output_buf: torch.Tensor | None = field(default=None, repr=False)
    _num_buffered: int = field(default=0, repr=False)

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def modifies_logits(self) -> bool:
        return bool(self.repetition or self.presence_or_frequency or self.bias_ids is not None
                    or self.allowed_ids is not None or self.min_tokens > 0 or self.processors)

    def prompt_ids(self, device: torch.device) -> torch.Tensor:
        if self._prompt_ids is None:
            self._prompt_ids = torch.tensor(self.token_ids[:self.num_prompt_tokens], dtype=torch.int64,
                                            device=device)
        return self._prompt_ids

    def output_ids(self, device: torch.device) -> torch.Tensor:
        """The output token ids as a tensor, extended incrementally as `token_ids` grows."""
        n = self.num_output_tokens
        buf = self._output_buf
        if buf is None:
            buf = torch.empty(max(16, 2 * n), dtype=torch.int64, device=device)
        if n > buf.numel():
            grown = torch.empty(2 * n, dtype=torch.int64, device=device)
            grown[:self._num_buffered] = buf[:self._num_buffered]
            buf = grown
        if n > self._num_buffered:
            start = self.num_prompt_tokens + self._num_buffered
            buf[self._num_buffered:n] = torch.tensor(self.token_ids[start:], dtype=torch.int64)
            self._num_buffered = n
        self._output_buf = buf
        return buf[:n]


@dataclass
class StepParams:
    """The parameter rows of one step's sampled requests, on the device: `column(TEMPERATURE)` etc.
    are `[n]`, in the order of the rows they were gathered for."""

    table: torch.Tensor  # [n, columns] float32

    def column(self, which: int) -> torch.Tensor:
        return self.table[:, which]

    def rows(self, positions: torch.Tensor | None) -> StepParams:
        return self if positions is None else StepParams(self.table[positions])


class SamplingStates:
    """The persistent parameter table of the live requests: one row per slot, slots reused."""

    def __init__(self, vocab_size: int, device: torch.device | str):
        self.vocab_size = vocab_size
        self.device = torch.device(device)
        self._table = np.zeros((_INITIAL_CAPACITY, _NUM_COLUMNS), dtype=np.float32)
        self._free_slots = list(range(_INITIAL_CAPACITY - 1, -1, -1))

    @property
    def num_live(self) -> int:
        return self._table.shape[0] - len(self._free_slots)

    def add(self, params: SamplingParams, token_ids: list[int], num_prompt_tokens: int,
            stop_token_ids_for_min_tokens: list[int]) -> RequestSampling:
        """Builds a request's state and claims its row. `token_ids` is kept by reference. A seeded request
        with outputs already (resumed after a preemption) continues its stream at `seed + num outputs`.
        Raises (leaving nothing behind) only if the state cannot be built."""
        greedy = params.sampling_type_greedy
        generator = None
        if params.seed is not None and not greedy:
            generator = make_generator(params.seed + len(token_ids) - num_prompt_tokens, self.device)
        bias_ids = bias_values = allowed = None
        if params.logit_bias:
            bias_ids = torch.tensor(list(params.logit_bias.keys()), dtype=torch.int64, device=self.device)
            bias_values = torch.tensor(list(params.logit_bias.values()), dtype=torch.float32,
                                       device=self.device)
        if params.allowed_token_ids is not None:
            allowed = torch.tensor(params.allowed_token_ids, dtype=torch.int64, device=self.device)
        processors = [(f, processor_arity(f)) for f in params.logits_processors or ()]
        temperature = 1.0 if greedy else float(params.temperature)
        top_k = params.top_k if not greedy and 0 < params.top_k < self.vocab_size else 0
        top_p = 1.0 if greedy else float(params.top_p)
        min_p = 0.0 if greedy else float(params.min_p)
        values = [0.0] * _NUM_COLUMNS
        values[TEMPERATURE], values[TOP_P], values[MIN_P] = temperature, top_p, min_p
        values[TOP_K] = float(top_k or self.vocab_size)
        values[REPETITION] = float(params.repetition_penalty)
        values[PRESENCE] = float(params.presence_penalty)
        values[FREQUENCY] = float(params.frequency_penalty)
        slot = self._claim_slot()
        self._table[slot] = values
        return RequestSampling(
            slot=slot, token_ids=token_ids, num_prompt_tokens=num_prompt_tokens, greedy=greedy, top_k=top_k,
            top_p=top_p, min_p=min_p, scales_temperature=temperature != 1.0,
            repetition=values[REPETITION] != 1.0,
            presence_or_frequency=values[PRESENCE] != 0.0 or values[FREQUENCY] != 0.0,
            bias_ids=bias_ids, bias_values=bias_values, allowed_ids=allowed, min_tokens=params.min_tokens,
            stop_token_ids_for_min_tokens=list(stop_token_ids_for_min_tokens), processors=processors,
            num_logprobs=params.logprobs, generator=generator)

    def remove(self, row: RequestSampling) -> None:
        """Frees the request's row; `row` must not be sampled afterwards."""
        self._free_slots.append(row.slot)

    def gather(self, rows: list[RequestSampling]) -> StepParams:
        """The rows' parameters on the device: one host gather, one non-blocking copy."""
        table = self._table[[r.slot for r in rows]]
        return StepParams(torch.from_numpy(table).to(self.device, non_blocking=True))

    def _claim_slot(self) -> int:
        if not self._free_slots:
            old = self._table.shape[0]
            grown = np.zeros((2 * old, _NUM_COLUMNS), dtype=np.float32)
            grown[:old] = self._table
            self._table = grown
            self._free_slots = list(range(2 * old - 1, old - 1, -1))
        return self._free_slots.pop()
