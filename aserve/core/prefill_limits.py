"""How prefills share a step (vLLM's scheduler arguments): `max_num_partial_prefills`,
`max_long_partial_prefills`, `long_prefill_token_threshold` and `scheduler_delay_factor`.

- A prefill chunk is capped at `long_prefill_token_threshold` tokens (when > 0), so one long prompt
  cannot take a whole step's budget; a prompt longer than the threshold is "long".
- A "partial" prefill is one whose chunk this step does not finish its prompt. At most
  `max_num_partial_prefills` run per step, at most `max_long_partial_prefills` of them long; a prefill
  over the limits waits (running) or is passed over for a later request (waiting), so short prompts
  get through while long ones prefill.
- `scheduler_delay_factor` > 0: while requests run, waiting ones are admitted only once the head of
  the queue has waited longer than factor x the latency of the last step that ran a prompt (vLLM's
  rule; it batches arrivals into fewer prefill steps).

With the defaults (1, 1, 0, 0.0) nothing changes: one partial prefill per step, no cap, no delay.
"""

from __future__ import annotations

import time
from collections.abc import Callable

from aserve.config import SchedulerConfig
from aserve.core.request import Request


class PrefillLimits:
    """`clock`: wall-clock seconds (as `Request.arrival_time`)."""

    def __init__(self, config: SchedulerConfig, clock: Callable[[], float] = time.time):
        self.max_partial = config.max_num_partial_prefills
        self.max_long = config.max_long_partial_prefills
        self.threshold = config.long_prefill_token_threshold
        self.delay_factor = config.scheduler_delay_factor
        self.clock = clock
        self.num_partial = 0
        self.num_long = 0
        self._prev_time = clock()
        self._prev_ran_prompt = False
        self._last_prompt_latency = 0.0

    def start_step(self) -> None:
        self.num_partial = self.num_long = 0

    def allowed(self, req: Request, num_new: int, remaining: int) -> int:
        """The tokens `req` may take this step out of `num_new` (0: it must wait); `remaining` is what it
        has left to compute. Counts it when it stays a partial prefill."""
        if req.num_computed_tokens >= req.num_prompt_tokens:
            return num_new  # decoding
        if 0 < self.threshold < num_new:
            num_new = self.threshold
        if num_new >= remaining:
            return num_new  # the prompt completes this step
        is_long = 0 < self.threshold < req.num_prompt_tokens
        if self.num_partial >= self.max_partial or (is_long and self.num_long >= self.max_long):
            return 0
        self.num_partial += 1
        self.num_long += is_long
        return num_new

    def may_admit(self, oldest_arrival: float, any_running: bool) -> bool:
        """`scheduler_delay_factor`'s rule for admitting waiting requests this step."""
        if self.delay_factor <= 0 or not any_running:
            return True
        return self.clock() - oldest_arrival > self.delay_factor * self._last_prompt_latency

    def end_step(self, ran_prompt: bool) -> None:
        """After scheduling: whether the step runs any prompt tokens (its latency is measured at the next step)."""
        now = self.clock()
        if self._prev_ran_prompt:
            self._last_prompt_latency = now - self._prev_time
        self._prev_time, self._prev_ran_prompt = now, ran_prompt
