"""The scheduler's record of the steps in flight: pipeline parallelism and async scheduling.

With pipeline parallelism (`max_steps_in_flight` > 1, one step per stage) a request in a step in flight is
left out of later steps until that step's `update`.

With async scheduling (`--async-scheduling`, vLLM's flag) the engine keeps two steps in flight: while the
runner computes step N the scheduler builds step N+1 and hands it over, so the runner starts it the moment
step N ends instead of waiting for a round trip through the scheduler. A request that step N samples for
is scheduled again in step N+1 for one more token whose id the scheduler does not know yet: a
*placeholder* (`Request.num_output_placeholders`). The runner takes that input from its own state, where
step N appended the token it sampled. When step N's output arrives the placeholder becomes the real
token (`update` appends it as usual). A request runs ahead only where the scheduler knows what it
computes: a decode's next token (never past `max_tokens` or `max_model_len`) or a prompt's next chunk. A
request that stops in step N (EOS, a stop token or string, an abort) has its token of step N+1 computed
and dropped, as vLLM does. Requests in flight are never preempted, and a request running ahead never
preempts: when one finds no free block, no request after it runs ahead in that step, so the requests the
preemption policy would pick first are out of flight (preemptible) when the next step is scheduled.

Why this is safe for the KV cache: the runner executes steps in order, so a block freed while step N+1
is in flight (its request stopped in step N) is written by step N+1 before any later step can read it
for another request; the position step N+1 writes is past the request's known tokens, in a block the
prefix cache has not registered (blocks are registered only up to the known tokens).
"""

from __future__ import annotations

from collections import deque

from aserve.core.request import Request


class StepsInFlight:
    """`pipelined`: several steps may be in flight; `ahead`: async scheduling (requests run ahead)."""

    def __init__(self, pipelined: bool, ahead: bool):
        self.pipelined = pipelined
        self.ahead = ahead
        self._counts: dict[str, int] = {}  # request id -> steps in flight it is in
        self._samplers: deque[list[Request]] = deque()  # per step in flight (async): the requests it samples for

    def __contains__(self, req_id: str) -> bool:
        return req_id in self._counts

    def __len__(self) -> int:
        """Requests in steps in flight."""
        return len(self._counts)

    def may_run_ahead(self, req: Request) -> bool:
        """Whether `req`, in a step in flight, may be in the next step too (async scheduling): the step in
        flight samples for it and one more token stays within its `max_tokens`, or it is prefilling and
        prompt tokens are left (known tokens: its next chunk)."""
        if not self.ahead:
            return False
        if req.num_output_placeholders:
            return req.num_output_tokens + req.num_output_placeholders < req.max_tokens
        return req.num_computed_tokens < req.num_tokens

    def started(self, scheduled: list[Request]) -> None:
        """A step with these requests was scheduled (their `num_computed_tokens` already count it). A step
        that schedules no request adds nothing here (it may never reach the runner, or `finished`)."""
        if not self.pipelined or not scheduled:
            return
        counts = self._counts
        samplers: list[Request] = []
        for req in scheduled:
            counts[req.request_id] = counts.get(req.request_id, 0) + 1
            if (self.ahead and req.pooling_params is None
                    and req.num_computed_tokens >= req.num_tokens + req.num_output_placeholders):
                req.num_output_placeholders += 1  # this step samples its next token
                samplers.append(req)
        if self.ahead:
            self._samplers.append(samplers)

    def finished(self, scheduled_req_ids: list[str]) -> None:
        """The oldest step in flight (with these request ids) came back, before `update` applies it."""
        if not self.pipelined or not scheduled_req_ids:
            return
        counts = self._counts
        for req_id in scheduled_req_ids:
            left = counts.get(req_id, 0) - 1
            if left > 0:
                counts[req_id] = left
            else:
                counts.pop(req_id, None)
        if self.ahead:
            for req in self._samplers.popleft():
                req.num_output_placeholders -= 1
