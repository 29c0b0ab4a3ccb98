"""`Retry-After` for a 429, from how fast the engine has recently been draining its queue.

`DrainRate` is a stat logger (the engine calls `record` once per step): it keeps the last
`window_s` seconds of finished requests and computed prompt tokens. `retry_after_s(num_reqs,
num_tokens)` is the expected time for that much queued work ahead to drain at the recent rates,
clamped to [`MIN_RETRY_AFTER_S`, `MAX_RETRY_AFTER_S`]. With nothing finished in the window the rate
is taken as at most one request (one token) over the window, so an engine that has not finished
anything yet asks for a long wait rather than a short one.
"""

from __future__ import annotations

import math
import time
from collections import deque
from collections.abc import Callable

from aserve.engine.stats import IterationStats, SchedulerStats

MIN_RETRY_AFTER_S = 1
MAX_RETRY_AFTER_S = 60


class DrainRate:
    """Recent completion rates of requests and prompt tokens; cheap to `record` (every step)."""

    def __init__(self, window_s: float = 30.0, clock: Callable[[], float] = time.monotonic) -> None:
        self.window_s = window_s
        self._clock = clock
        self._started = clock()
        self._steps: deque[tuple[float, int, int]] = deque()  # (time, requests finished, prompt tokens)
        self._num_reqs = 0  # sums over `_steps`
        self._num_tokens = 0

    def record(self, scheduler_stats: SchedulerStats, iteration_stats: IterationStats) -> None:
        num_reqs, num_tokens = len(iteration_stats.finished_requests), iteration_stats.num_prompt_tokens
        if num_reqs or num_tokens:
            self._steps.append((self._clock(), num_reqs, num_tokens))
            self._num_reqs += num_reqs
            self._num_tokens += num_tokens

    def rates(self) -> tuple[float, float]:
        """(requests per second, prompt tokens per second) over the window; never 0."""
        now = self._clock()
        steps = self._steps
        while steps and steps[0][0] < now - self.window_s:
            _, num_reqs, num_tokens = steps.popleft()
            self._num_reqs -= num_reqs
            self._num_tokens -= num_tokens
        span = max(min(now - self._started, self.window_s), 1.0)
        return max(self._num_reqs, 1) / span, max(self._num_tokens, 1) / span

    def retry_after_s(self, num_reqs: int, num_tokens: int = 0) -> int:
        """Whole seconds for `num_reqs` requests and `num_tokens` prompt tokens ahead to drain."""
        req_rate, token_rate = self.rates()
        wait = max(num_reqs / req_rate, num_tokens / token_rate)
        return min(max(math.ceil(wait), MIN_RETRY_AFTER_S), MAX_RETRY_AFTER_S)
