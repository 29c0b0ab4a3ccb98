"""The step's token bitmask for the whole batch: filled in one call, applied in place on logits.

Layout: one int32 row per logits row, `ceil(vocab_size / 32)` words, bit `t % 32` of word
`t // 32` set when token `t` is allowed (xgrammar's layout). Only the rows of guided requests
are filled and applied; other rows of the logits are left untouched.

Per step the runner does (see the README's "Structured outputs (engine layer)"):
    mask = builder.fill(rows, states)          # CPU, one batched call (overlaps a launched forward)
    apply_bitmask(logits, mask, rows)          # in place, on the logits' device
    ... sample ...
    accept_tokens(states, sampled_ids)         # advance each state with its sampled token
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch
import xgrammar as xgr

from aserve.structured_outputs.state import GrammarState, fill_stop_only

if TYPE_CHECKING:
    from aserve.structured_outputs.guidance import GuidanceState

    AnyGrammarState = GrammarState | GuidanceState


def bitmask_words(vocab_size: int) -> int:
    """int32 words per row for a vocabulary of `vocab_size` tokens."""
    return (vocab_size + 31) // 32


class BitmaskBuilder:
    """Owns the CPU bitmask (`max_num_rows` rows, pinned when `pin_memory`) and the backends'
    multi-threaded batch fillers. One per runner; `fill` is not re-entrant."""

    def __init__(self, vocab_size: int, max_num_rows: int, *, max_threads: int | str = "auto",
                 pin_memory: bool = False):
        self.vocab_size = vocab_size
        self.bitmask = torch.full((max_num_rows, bitmask_words(vocab_size)), -1, dtype=torch.int32,
                                  pin_memory=pin_memory)
        self._max_threads = max_threads
        self._xgr_batch = xgr.BatchGrammarMatcher(max_threads)
        self._guidance_executor = None  # made on the first guidance state (llguidance is optional)

    def fill(self, rows: Sequence[int], states: Sequence[AnyGrammarState]) -> torch.Tensor:
        """Fills `bitmask[rows[i]]` from `states[i]` for every i, one batched call per backend;
        returns the whole CPU bitmask (rows not listed hold stale data: pass the same `rows` to
        apply). A terminated state's row allows only its stop tokens.
        """
        if len(rows) != len(states):
            raise ValueError(f"{len(rows)} rows for {len(states)} grammar states")
        xgr_rows, xgr_matchers, ll_rows, ll_states = [], [], [], []
        for row, state in zip(rows, states):
            if state.is_terminated():
                fill_stop_only(self.bitmask, row, state.stop_token_ids)
            elif isinstance(state, GrammarState):
                xgr_rows.append(int(row))
                xgr_matchers.append(state.matcher)
            else:
                ll_rows.append(int(row))
                ll_states.append(state)
        if xgr_matchers:
            self._xgr_batch.batch_fill_next_token_bitmask(xgr_matchers, self.bitmask, xgr_rows)
        if ll_states:
            from aserve.structured_outputs import guidance

            if self._guidance_executor is None:
                threads = self._max_threads if isinstance(self._max_threads, int) else None
                self._guidance_executor = guidance.make_executor(threads)
            guidance.fill_batch(self._guidance_executor, ll_rows, ll_states, self.bitmask)
        return self.bitmask


def apply_bitmask(logits: torch.Tensor, bitmask: torch.Tensor, rows: Sequence[int]) -> None:
    """Sets `logits[r, t] = -inf` for every token t not allowed by `bitmask[r]`, for r in `rows`.

    `logits` is (num_rows, vocab) on any device; `bitmask` is copied there (non-blocking from
    pinned memory) when it lives elsewhere. Bits past the logits' width are ignored; logits past
    the bitmask's width are masked (never allowed).
    """
    if not rows:
        return
    if bitmask.device != logits.device:
        bitmask = bitmask.to(logits.device, non_blocking=True)
    width = bitmask.shape[1] * 32
    if logits.shape[-1] > width:
        logits[list(rows), width:] = float("-inf")
    xgr.apply_token_bitmask_inplace(logits, bitmask, vocab_size=min(logits.shape[-1], width),
                                    indices=[int(r) for r in rows])


def accept_tokens(states: Sequence[AnyGrammarState], token_ids: Sequence[int]) -> list[bool]:
    """Advances `states[i]` with `token_ids[i]` (xgrammar states in one batched call); False where
    a state rejected its token (the runner then fails that request). Terminated states must not
    be passed."""
    if len(states) != len(token_ids):
        raise ValueError(f"{len(token_ids)} tokens for {len(states)} grammar states")
    accepted = [False] * len(states)
    xgr_idx = [i for i, s in enumerate(states) if isinstance(s, GrammarState)]
    if xgr_idx:
        results = xgr.BatchGrammarMatcher.batch_accept_token([states[i].matcher for i in xgr_idx],
                                                             [int(token_ids[i]) for i in xgr_idx])
        for i, ok in zip(xgr_idx, results):
            accepted[i] = ok
            if ok:
                states[i].num_accepted += 1
    for i, state in enumerate(states):
        if not isinstance(state, GrammarState):
            accepted[i] = state.accept_token(token_ids[i])
    return accepted
