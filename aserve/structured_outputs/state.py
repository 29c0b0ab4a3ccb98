"""`GrammarState`: one request's position in its grammar (an xgrammar matcher), runner side.

Contract with the runner: a state advances only with tokens the request really produced, in
order. Once the grammar is complete its mask allows only the stop tokens; accepting one
terminates the state (`is_terminated`), after which it accepts nothing and must not be advanced.
A request that loses its runner state (preemption) gets a new state rebuilt from its output
tokens (`rebuild`), which reaches exactly the state of an uninterrupted run.
"""

from __future__ import annotations

from collections.abc import Sequence

import xgrammar as xgr


class GrammarStateError(ValueError):
    """A token sequence the grammar rejects (e.g. replaying outputs into a different grammar)."""


class ReplayableState:
    """What every backend's state shares, built on its `accept_token` and `reset`."""

    __slots__ = ()

    def accept_tokens(self, token_ids: Sequence[int]) -> int:
        """Advances token by token; returns how many were accepted before the first rejection."""
        for i, token_id in enumerate(token_ids):
            if not self.accept_token(token_id):
                return i
        return len(token_ids)

    def rebuild(self, token_ids: Sequence[int]) -> None:
        """Resets, then replays `token_ids` (a resumed request's outputs so far).

        Raises GrammarStateError (and leaves the state reset) if the grammar rejects one of them.
        """
        self.reset()
        accepted = self.accept_tokens(token_ids)
        if accepted != len(token_ids):
            self.reset()
            raise GrammarStateError(
                f"output token {accepted} (id {int(token_ids[accepted])}) is not allowed by the grammar")


class GrammarState(ReplayableState):
    """A per-request matcher over a compiled grammar; cheap to create, not thread-safe."""

    __slots__ = ("matcher", "num_accepted", "stop_token_ids")

    def __init__(self, compiled: xgr.CompiledGrammar, stop_token_ids: Sequence[int] | None = None,
                 *, max_rollback_tokens: int = 0):
        # max_rollback_tokens is kept for API stability; xgrammar >= 0.2 always allows unlimited rollback.
        del max_rollback_tokens
        stops = list(stop_token_ids) if stop_token_ids else None
        self.matcher = xgr.GrammarMatcher(compiled, override_stop_tokens=stops)
        self.stop_token_ids: list[int] = list(self.matcher.stop_token_ids)
        self.num_accepted = 0  # tokens accepted since the last reset (the stop token included)

    def accept_token(self, token_id: int) -> bool:
        """Advances by one token; False (and no change) if the grammar does not allow it."""
        ok = self.matcher.accept_token(int(token_id))
        if ok:
            self.num_accepted += 1
        return ok

    def is_terminated(self) -> bool:
        """True once a stop token was accepted (the request is over as far as the grammar goes)."""
        return self.matcher.is_terminated()

    def is_completed(self) -> bool:
        """True when the text so far is a complete sentence of the grammar (only stops remain
        allowed) or the state has terminated."""
        return self.matcher.is_completed()

    def rollback(self, num_tokens: int) -> None:
        """Undoes the last `num_tokens` accepted tokens (speculative decoding, stop-string trims)."""
        if num_tokens < 0 or num_tokens > self.num_accepted:
            raise ValueError(f"cannot roll back {num_tokens} of {self.num_accepted} accepted tokens")
        if num_tokens:
            self.matcher.rollback(num_tokens)
            self.num_accepted -= num_tokens

    def reset(self) -> None:
        """Back to the start of the grammar."""
        self.matcher.reset()
        self.num_accepted = 0

    def fill_bitmask(self, bitmask, row: int = 0) -> None:
        """Writes the allowed next tokens into `bitmask[row]` (int32 CPU tensor, 1 bit per token).

        A terminated state allows only its stop tokens (xgrammar itself refuses to fill one).
        """
        if self.matcher.is_terminated():
            fill_stop_only(bitmask, row, self.stop_token_ids)
        else:
            self.matcher.fill_next_token_bitmask(bitmask, row)


def fill_stop_only(bitmask, row: int, stop_token_ids: Sequence[int]) -> None:
    """Sets `bitmask[row]` to allow exactly `stop_token_ids`."""
    bitmask[row].zero_()
    for token_id in stop_token_ids:
        word, bit = divmod(int(token_id), 32)
        if word < bitmask.shape[1]:
            value = int(bitmask[row, word]) | (1 << bit)
            bitmask[row, word] = value - (1 << 32) if value >= (1 << 31) else value  # int32 wrap
