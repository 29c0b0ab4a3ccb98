"""N-gram prompt lookup (vLLM's `ngram` method): drafts copied from earlier in the request's own tokens.

For n from `max_n` down to `min_n`, the request's last n tokens are searched for earlier in its
tokens (prompt and outputs); the tokens that followed an occurrence are the drafts (up to k): the
latest occurrence followed by k tokens, else the earliest (the longest continuation; inside a
repeating stretch the latest would stop at the repeat). No match: no drafts. Host-only and cheap: one vectorised comparison per n over a
window of the most recent tokens.
"""

from __future__ import annotations

import numpy as np

from aserve.runner.spec_decode.base import Proposer

# Only the most recent tokens are searched, so a step's lookup cost does not grow with the context.
_SEARCH_WINDOW = 4096


def propose_ngram(token_ids: list[int], k: int, min_n: int, max_n: int) -> list[int]:
    """Up to `k` drafts following the longest earlier match of the last n tokens (see the module docstring)."""
    num = len(token_ids)
    if num < min_n + 1 or k <= 0:
        return []
    tail = token_ids[-_SEARCH_WINDOW:] if num > _SEARCH_WINDOW else token_ids
    arr = np.asarray(tail, dtype=np.int64)
    size = arr.shape[0]
    for n in range(min(max_n, size - 1), min_n - 1, -1):
        pattern = arr[size - n:]
        # Candidate starts: every window but the suffix itself, each followed by at least one token.
        windows = np.lib.stride_tricks.sliding_window_view(arr[:size - 1], n)
        hits = np.flatnonzero((windows == pattern).all(axis=1))
        if hits.size:
            full = hits[hits + n + k <= size]
            start = int(full[-1] if full.size else hits[0]) + n
            return tail[start:start + k]
    return []


class NgramProposer(Proposer):
    """Proposes drafts for the requests that sampled this step, from their own token lists."""

    def __init__(self, num_speculative_tokens: int, prompt_lookup_min: int, prompt_lookup_max: int):
        self.k = num_speculative_tokens
        self.min_n = prompt_lookup_min
        self.max_n = prompt_lookup_max

    def propose(self, req_ids: list[str], states: dict, inputs=None) -> dict[str, list[int]]:
        """req_id -> drafts (requests without a match are left out). `states`: the runner's request
        states (their `token_ids` include this step's tokens); `inputs` is not needed."""
        drafts = {}
        for req_id in req_ids:
            found = propose_ngram(states[req_id].token_ids, self.k, self.min_n, self.max_n)
            if found:
                drafts[req_id] = found
        return drafts
