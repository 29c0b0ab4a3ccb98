"""The scheduler's side of multi-step decode (`--num-scheduler-steps N`, as vLLM's v0 engine had it).

When every request a step schedules is decoding (one token each, no prefill, no swap-in, no
admission), the step becomes a multi-step call: the runner runs up to N decode steps back to back,
feeding each step's sampled token into the next, with no scheduler or executor round trip between
them. Each request gets its own count (`SchedulerOutput.decode_steps`): never more tokens than its
`max_tokens` leaves, nor past `max_model_len`; a request that stops early (EOS, a stop token) has the
rest of its tokens computed and dropped by the stop rules, as in vLLM. A step with any prompt chunk
longer than one token runs one step (a request whose prompt ends with exactly one uncomputed token
counts as decoding: its first sampled token then arrives with the call).

KV slots: a decoding request reserves max(`num_lookahead_slots`, its count - 1) slots past its
scheduled token, so the call's later steps write into blocks it already holds. After the call, the
tokens the runner computed beyond the scheduled one count as computed (`settle`).
"""

from __future__ import annotations

from aserve.core.request import Request


class MultiStepPolicy:
    """`num_steps` 1: multi-step decode off (every count is 1, `plan` is always empty)."""

    def __init__(self, num_steps: int, max_model_len: int):
        self.num_steps = num_steps
        self.max_model_len = max_model_len

    def steps_for(self, req: Request) -> int:
        """How many decode steps the decoding request `req` may run in one call (>= 1)."""
        if self.num_steps == 1:
            return 1
        left = min(req.max_tokens - req.num_output_tokens, self.max_model_len - req.num_tokens)
        return max(1, min(self.num_steps, left))

    def plan(self, counts: dict[str, int], num_scheduled: dict[str, int]) -> dict[str, int]:
        """The step's `decode_steps`: `counts` (every decoding request's `steps_for`; empty with multi-step
        off) when every scheduled request is among them and one runs more than one step; else {}."""
        if len(counts) != len(num_scheduled) or not any(n > 1 for n in counts.values()):
            return {}
        return counts if all(r in counts for r in num_scheduled) else {}

    @staticmethod
    def settle(req: Request, tokens: list[int], first_step: bool) -> None:
        """After a multi-step call (or one step of it, streamed): the KV of every token but the last
        sampled is computed. A streamed step after the first holds one token whose predecessor this
        step computed."""
        req.num_computed_tokens += len(tokens) - (1 if first_step else 0)
