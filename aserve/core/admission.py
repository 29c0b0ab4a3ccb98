"""Admission: which waiting requests a step starts (the scheduler's third pass, after running and
swapped requests), under the step's remaining token budget and `max_num_seqs`.

In queue order (fcfs with the batch shared fairly between clients, or priority), a request is
admitted when its prompt's uncomputed tokens (after prefix-cache hits) fit the budget, or a chunk of
them with chunked prefill, within the partial-prefill limits and the LoRA slots, and its blocks can
be allocated. Skipped: an n > 1 sibling whose leader's prompt is not computed yet, a request whose
adapter would exceed `max_loras`, one over the partial-prefill limits, and (priority policy, no
chunking) one too long for the budget; a later request may fit where they do not. Admission stops at
the first request whose blocks cannot be allocated.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from aserve.core.batch import EngineCoreEventType
from aserve.core.fair_queue import FairQueue
from aserve.core.request import Request, RequestStatus

if TYPE_CHECKING:
    from aserve.core.scheduler import Scheduler

_WAITING_LIKE = (RequestStatus.WAITING, RequestStatus.PREEMPTED)


def admit_waiting(sched: Scheduler, budget: int, num_scheduled: dict[str, int],
                  new_block_ids: dict[str, list[int]]) -> None:
    """Admits waiting requests into `sched.running`, recording each one's tokens and new blocks."""
    kv = sched.kv_cache_manager
    waiting = sched.waiting
    running = sched.running
    skipped: list[Request] = []
    if isinstance(waiting, FairQueue):
        waiting.start_step(running)
    while len(waiting) and budget > 0 and len(running) < sched.max_num_seqs:
        req = waiting.peek()
        if ((req.wait_for_req_id is not None and not _leader_ready(sched.requests, req.wait_for_req_id))
                or not sched.lora_slots.can_admit(req)):
            skipped.append(waiting.pop())
            continue
        computed_blocks, num_cached = kv.get_computed_blocks(req)
        num_new = req.num_tokens - num_cached
        if num_new > budget:
            if not sched.chunked_prefill:
                if sched.priority_policy:
                    skipped.append(waiting.pop())
                    continue
                break
            num_new = budget
        num_new = sched.prefill_limits.allowed(req, num_new, req.num_tokens - num_cached)
        if num_new == 0:  # over the partial-prefill limits: a later (shorter) request may fit
            skipped.append(waiting.pop())
            continue
        blocks = kv.allocate_slots(req, num_new + sched.num_lookahead_slots, computed_blocks)
        if blocks is None:
            break
        waiting.pop()
        sched.lora_slots.admit(req)
        if req.status == RequestStatus.WAITING:
            req.num_cached_tokens = num_cached
        req.status = RequestStatus.RUNNING
        req.num_computed_tokens = num_cached
        req.record_event(EngineCoreEventType.SCHEDULED)
        running.append(req)
        num_scheduled[req.request_id] = num_new
        new_block_ids[req.request_id] = blocks
        budget -= num_new
    if skipped:
        waiting.add_front_all(skipped)


def _leader_ready(requests: dict[str, Request], leader_id: str) -> bool:
    """An n > 1 sibling may start once its leader's prompt is computed (or the leader is gone)."""
    leader = requests.get(leader_id)
    if leader is None:
        return True
    if leader.status in _WAITING_LIKE:
        return False
    return leader.num_computed_tokens >= leader.num_prompt_tokens
