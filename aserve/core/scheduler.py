"""The scheduler: one rule, no phases.

Every step each request's `num_computed_tokens` catches up with its token count under a token
budget (`max_num_batched_tokens`) and a cap on running requests (`max_num_seqs`). Running requests
go first (a decode is one token; a running request still prefilling gets a chunk), then swapped
requests are swapped back in, then waiting requests are admitted (fcfs: arrival order, the batch
shared fairly between clients, see `fair_queue`; priority: lower `priority` first, then arrival).
When a running request cannot get blocks, a running request is preempted (recompute, or swap when
configured) and the allocation retried: under fcfs the latest admitted request of the client holding
the most running requests (a flooding client loses memory first; with one client, the last running
request); under priority the lowest-ranked one (`core/preemption.py`). At most `max_loras` LoRA
adapters run at once (`core/lora_slots.py`); prefills share a step as `core/prefill_limits.py` says.
With speculative decoding a decoding request also gets the drafts `core/spec_decoding.py` keeps; with
`--num-scheduler-steps` an all-decode step becomes a multi-step call (`core/multi_step.py`).

`schedule()` advances `num_computed_tokens` by what it schedules (the step is assumed to run); `update()`
appends the sampled tokens and applies the stop rules. With pipeline parallelism several steps are in
flight (`max_steps_in_flight`): a request in one is skipped by later ones and never preempted, until its
`update`; each step takes at most its share of the running requests, so the micro-batches balance. With
async scheduling two steps are in flight and a decoding request runs one step ahead of its known tokens
(`core/steps_in_flight.py`).
The runner protocol: `aserve.core.batch`.
"""

from __future__ import annotations

from collections.abc import Iterable

from aserve.config import CacheConfig, KVCacheInfo, SchedulerConfig
from aserve.config.speculative import SpeculativeConfig
from aserve.core.admission import admit_waiting
from aserve.core.batch import (
    CachedRequestData,
    EngineCoreEventType,
    EngineCoreOutput,
    NewRequestData,
    RunnerOutput,
    SchedulerOutput,
)
from aserve.core.fair_queue import FairQueue
from aserve.core.kv_cache_manager import KVCacheManager
from aserve.core.lora_slots import LoRASlots
from aserve.core.multi_step import MultiStepPolicy
from aserve.core.preemption import victim_index
from aserve.core.prefill_limits import PrefillLimits
from aserve.core.request import Request, RequestStatus
from aserve.core.request_queue import FCFSQueue, PriorityQueue
from aserve.core.spec_decoding import DraftPolicy
from aserve.core.steps_in_flight import StepsInFlight
from aserve.core.stats import SchedulerStats
from aserve.core.stats_reporter import StatsReporter

_WAITING_LIKE = (RequestStatus.WAITING, RequestStatus.PREEMPTED)
_RUNNING = RequestStatus.RUNNING


class Scheduler:
    """Owns the request queues and the KV cache manager. Not thread-safe: one caller at a time."""

    def __init__(self, scheduler_config: SchedulerConfig, cache_config: CacheConfig, kv_info: KVCacheInfo,
                 max_loras: int | None = None, prefill_limits: PrefillLimits | None = None,
                 speculative: SpeculativeConfig | None = None) -> None:
        """`max_loras` None: LoRA is off. `prefill_limits`: default from the config (tests pass a clock).
        `speculative` None: speculative decoding is off."""
        mode = scheduler_config.preemption_mode or "recompute"  # validated with the engine arguments
        self.config = scheduler_config
        self.max_num_batched_tokens = scheduler_config.max_num_batched_tokens
        self.max_num_seqs = scheduler_config.max_num_seqs
        self.max_model_len = scheduler_config.max_model_len
        self.chunked_prefill = scheduler_config.enable_chunked_prefill
        self.priority_policy = scheduler_config.policy == "priority"
        self.block_size = kv_info.block_size
        self.kv_cache_manager = KVCacheManager(
            num_blocks=kv_info.num_blocks,
            block_size=kv_info.block_size,
            enable_caching=cache_config.enable_prefix_caching,
            num_cpu_blocks=kv_info.num_cpu_blocks,
        )
        self.swap_enabled = mode == "swap" and kv_info.num_cpu_blocks > 0
        self.requests: dict[str, Request] = {}  # every unfinished request
        self.waiting: FairQueue | PriorityQueue = PriorityQueue() if self.priority_policy else FairQueue()
        self.swapped: FCFSQueue | PriorityQueue = PriorityQueue() if self.priority_policy else FCFSQueue()
        self.running: list[Request] = []
        self.lora_slots = LoRASlots(max_loras)
        self.prefill_limits = prefill_limits or PrefillLimits(scheduler_config)
        self.drafts = DraftPolicy(speculative, self.max_model_len)
        self.num_lookahead_slots = scheduler_config.num_lookahead_slots  # KV slots past the step's tokens
        self.multi_step = MultiStepPolicy(scheduler_config.num_scheduler_steps, self.max_model_len)
        self.num_preemptions = 0  # cumulative
        self._stats = StatsReporter()
        self._finished_req_ids: list[str] = []  # to report in the next SchedulerOutput
        self._runner_req_ids: set[str] = set()  # requests whose state the runner holds
        # several steps in flight (pipeline parallelism, async scheduling): requests in a step not yet through
        # `update` are never preempted, and skipped by later steps unless they run ahead (async)
        self.pipelined = scheduler_config.max_steps_in_flight > 1
        self._in_flight = StepsInFlight(self.pipelined, scheduler_config.async_scheduling)

    # -- intake and queries ----------------------------------------------------------------------
    def add_request(self, request: Request) -> None:
        """Queues a new request (status WAITING). Raises ValueError on a duplicate id."""
        if request.request_id in self.requests or request.request_id in self._in_flight:
            raise ValueError(f"request_id: {request.request_id!r} is already scheduled")
        request.status = RequestStatus.WAITING
        self.requests[request.request_id] = request
        self.waiting.add(request)

    def get_request(self, req_id: str) -> Request | None:
        return self.requests.get(req_id)

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests)

    def num_queued_prompt_tokens(self) -> int:
        """Prompt tokens of unfinished requests not yet computed (O(requests): for admission caps)."""
        return sum(max(r.num_prompt_tokens - r.num_computed_tokens, 0) for r in self.requests.values())

    def abort_requests(self, req_ids: str | Iterable[str]) -> None:
        """Finishes the requests as FINISHED_ABORTED; unknown or finished ids are ignored."""
        self.finish_requests(req_ids, RequestStatus.FINISHED_ABORTED)

    def finish_requests(self, req_ids: str | Iterable[str], status: RequestStatus) -> None:
        """Finishes the requests with `status` (a finished status): blocks are freed now and the ids
        go to the runner in the next SchedulerOutput.finished_req_ids. Unknown ids are ignored."""
        if not RequestStatus.is_finished(status):
            raise ValueError(f"status: must be a finished status, got {status!r}")
        if isinstance(req_ids, str):
            req_ids = (req_ids,)
        for req_id in req_ids:
            req = self.requests.get(req_id)
            if req is None:
                continue
            if req.status == RequestStatus.RUNNING:
                self.running.remove(req)
            elif req.status in _WAITING_LIKE:
                self.waiting.remove(req)
            elif req.status == RequestStatus.SWAPPED:
                self.swapped.remove(req)
            self._finish(req, status)

    def _finish(self, req: Request, status: RequestStatus) -> None:
        """Marks finished and releases everything; the caller has taken it out of its queue."""
        req.status = status
        self.kv_cache_manager.free(req)
        del self.requests[req.request_id]
        self._runner_req_ids.discard(req.request_id)
        self._finished_req_ids.append(req.request_id)

    # -- schedule --------------------------------------------------------------------------------
    def schedule(self) -> SchedulerOutput:
        kv = self.kv_cache_manager
        budget = self.max_num_batched_tokens
        chunked = self.chunked_prefill
        running = self.running
        num_scheduled: dict[str, int] = {}
        new_block_ids: dict[str, list[int]] = {}
        swap_out: list[tuple[int, int]] = []
        swap_in: list[tuple[int, int]] = []
        preempted = False
        limits = self.prefill_limits
        limits.start_step()
        lookahead = self.num_lookahead_slots
        spec_tokens: dict[str, list[int]] = {}
        speculate = self.drafts.step_enabled(len(running))
        decode_counts: dict[str, int] = {}  # decoding request -> decode steps it may run (multi-step)

        # 1. Running requests, in order.
        i = 0
        in_flight = self._in_flight
        # pipelined: the running requests are shared among the steps in flight (micro-batches), so that
        # every stage has work; a step takes at most its share
        pp_share = self.pipelined and not in_flight.ahead
        share = -(-len(running) // self.config.max_steps_in_flight) if pp_share else len(running)
        while i < len(running) and budget > 0 and len(num_scheduled) < share:
            req = running[i]
            ahead = req.request_id in in_flight
            if ahead and not in_flight.may_run_ahead(req):
                i += 1
                continue
            remaining = min(req.num_tokens + req.num_output_placeholders, self.max_model_len) - req.num_computed_tokens
            drafts = self.drafts.drafts_for(req) if speculate and remaining == 1 else ()
            wanted = remaining + len(drafts)
            num_new = limits.allowed(req, min(wanted, budget), wanted) if remaining > 0 else 0
            if num_new <= 0 or (num_new < remaining and not chunked):
                i += 1
                continue
            if num_new > remaining:
                spec_tokens[req.request_id] = drafts[:num_new - remaining]
            steps = self.multi_step.steps_for(req) if remaining == 1 == num_new else 1
            while True:
                blocks = kv.allocate_slots(req, num_new + max(lookahead, steps - 1))
                if blocks is not None or ahead:  # an ahead decode waits for its step rather than preempt
                    break
                victim_idx = self._victim_index()
                victim = running[victim_idx]
                budget += self._preempt(victim_idx, num_scheduled, new_block_ids, swap_out)
                spec_tokens.pop(victim.request_id, None)
                decode_counts.pop(victim.request_id, None)
                preempted = True
                if victim is req:
                    break
                if victim_idx < i:
                    i -= 1
            if blocks is None:  # preempted itself, or ahead without a block: the rest wait for the next step
                break
            num_scheduled[req.request_id] = num_new
            new_block_ids[req.request_id] = blocks
            budget -= num_new
            if remaining == 1 == num_new and self.multi_step.num_steps > 1:
                decode_counts[req.request_id] = steps
            i += 1

        # 2. Swapped requests come back before new ones are admitted; nothing is admitted in a step
        # that preempted (the blocks just freed would be fought over).
        if not preempted:
            self.lora_slots.start_step(running)
            while len(self.swapped) and budget > 0 and len(running) < self.max_num_seqs:
                req = self.swapped.peek()
                if not self.lora_slots.can_admit(req):
                    break
                remaining = req.num_tokens - req.num_computed_tokens
                num_new = min(remaining, budget)
                if num_new < remaining and not chunked:
                    break
                if not kv.can_swap_in(req, num_new + lookahead):
                    break
                self.swapped.pop()
                self.lora_slots.admit(req)
                swap_in.extend(kv.swap_in(req))
                req.status = RequestStatus.RUNNING
                running.append(req)
                if num_new > 0:
                    blocks = kv.allocate_slots(req, num_new + lookahead)
                    assert blocks is not None  # can_swap_in counted these
                    num_scheduled[req.request_id] = num_new
                    new_block_ids[req.request_id] = blocks
                    budget -= num_new

            # 3. Waiting requests.
            if not len(self.swapped) and (not len(self.waiting)
                                          or limits.may_admit(self.waiting.peek().arrival_time, bool(running))):
                admit_waiting(self, budget, num_scheduled, new_block_ids)

        # 4. The output, in running order; then the step's tokens count as computed.
        new_reqs: list[NewRequestData] = []
        cached_reqs: list[CachedRequestData] = []
        scheduled_ids: list[str] = []
        scheduled_nums: list[int] = []
        runner_ids = self._runner_req_ids
        for req in running:
            req_id = req.request_id
            n = num_scheduled.get(req_id)
            if n is None:
                continue
            if req_id in runner_ids:
                nc = req.num_computed_tokens
                # pipeline parallel: the decode input (sampled on the last stage); async: the runner has it
                tokens = req.all_token_ids[nc:nc + n] if pp_share and nc >= req.num_prompt_tokens else []
                cached_reqs.append(CachedRequestData(req_id, new_block_ids[req_id], nc, tokens))
            else:
                runner_ids.add(req_id)
                new_reqs.append(req.new_request_data(self.kv_cache_manager.get_block_ids(req_id)))
            scheduled_ids.append(req_id)
            scheduled_nums.append(n)
            req.num_computed_tokens += n
        finished, self._finished_req_ids = self._finished_req_ids, []
        in_flight.started([r for r in running if r.request_id in num_scheduled])
        if limits.delay_factor > 0:  # did this step run prompt tokens?
            limits.end_step(any(r.num_computed_tokens - num_scheduled[r.request_id] < r.num_prompt_tokens
                                for r in running if r.request_id in num_scheduled))
        return SchedulerOutput(new_requests=new_reqs, cached_requests=cached_reqs, scheduled_req_ids=scheduled_ids,
                               num_scheduled_tokens=scheduled_nums, finished_req_ids=finished,
                               blocks_to_swap_out=swap_out, blocks_to_swap_in=swap_in,
                               scheduled_spec_token_ids=spec_tokens,
                               propose_drafts=self.drafts.step_enabled(len(running)),
                               decode_steps=self.multi_step.plan(decode_counts, num_scheduled))

    def _victim_index(self) -> int:  # the running request to preempt (core/preemption.py), never one in flight
        if not self._in_flight:
            return victim_index(self.running, self.priority_policy)
        candidates = [r for r in self.running if r.request_id not in self._in_flight]
        return self.running.index(candidates[victim_index(candidates, self.priority_policy)])

    def _preempt(self, idx: int, num_scheduled: dict[str, int], new_block_ids: dict[str, list[int]],
                 swap_out: list[tuple[int, int]]) -> int:
        """Preempts running[idx] (undoing its scheduling this step); returns the budget it gave back."""
        req = self.running.pop(idx)
        req.spec_token_ids = []
        kv = self.kv_cache_manager
        req_id = req.request_id
        given_back = num_scheduled.pop(req_id, 0)
        new_block_ids.pop(req_id, None)
        if self.swap_enabled and kv.can_swap_out(req):
            swap_out.extend(kv.swap_out(req))
            req.status = RequestStatus.SWAPPED
            self.swapped.add_front(req)
        else:
            kv.free(req)
            req.status = RequestStatus.PREEMPTED
            req.num_computed_tokens = 0
            self.waiting.add_front(req)
        req.num_preemptions += 1
        req.record_event(EngineCoreEventType.PREEMPTED)
        self.num_preemptions += 1
        self._runner_req_ids.discard(req_id)
        self._finished_req_ids.append(req_id)
        return given_back

    # -- update ----------------------------------------------------------------------------------
    def update(self, scheduler_output: SchedulerOutput, runner_output: RunnerOutput) -> list[EngineCoreOutput]:
        """Applies one step's results: one EngineCoreOutput per request that sampled, got prompt logprobs,
        was pooled (and finished), finished, or failed alone in the runner (finish_reason "error")."""
        outputs: list[EngineCoreOutput] = []
        requests = self.requests
        self._in_flight.finished(scheduler_output.scheduled_req_ids)
        if runner_output.failed_requests:
            self._fail_requests(runner_output.failed_requests, outputs)
        for req_id, pooled in runner_output.pooled_outputs.items():
            req = requests.get(req_id)
            if req is not None and req.status is _RUNNING:  # else aborted while the step ran
                outputs.append(EngineCoreOutput(req_id=req_id, new_token_ids=[], finish_reason="stop", pooled=pooled,
                                                num_cached_tokens=req.num_cached_tokens, events=req.take_events()))
                self.finish_requests([req_id], RequestStatus.FINISHED_STOPPED)
        prompt_logprobs = runner_output.prompt_logprobs
        logprobs = runner_output.logprobs
        spec_scheduled = scheduler_output.scheduled_spec_token_ids
        decode_steps = scheduler_output.decode_steps
        drafts = runner_output.draft_token_ids
        any_finished = False
        for i, req_id in enumerate(runner_output.req_ids):
            req = requests.get(req_id)
            if req is None or req.status is not _RUNNING:
                continue  # aborted while the step ran
            tokens = runner_output.sampled_token_ids[i]
            if spec_scheduled:
                self.drafts.settle(req, spec_scheduled.get(req_id), tokens)
            elif req_id in decode_steps:
                self.multi_step.settle(req, tokens, runner_output.decode_step == 0)
            num_kept, status = req.append_step_tokens(tokens, self.max_model_len)
            if drafts or req.spec_token_ids:  # the next step's drafts; the verified ones are spent
                req.spec_token_ids = drafts.get(req_id, []) if status is None else []
            outputs.append(EngineCoreOutput(
                req_id=req_id,
                new_token_ids=tokens if num_kept == len(tokens) else tokens[:num_kept],
                new_logprobs=logprobs[i][:num_kept] if logprobs and logprobs[i] else [],
                new_prompt_logprobs=prompt_logprobs.get(req_id) if prompt_logprobs else None,
                finish_reason=RequestStatus.finish_reason(status) if status is not None else None,
                stop_reason=req.stop_reason,
                num_cached_tokens=req.num_cached_tokens,
                events=req.take_events() if req.events else [],
            ))
            if status is not None:
                any_finished = True
                self._finish(req, status)
        if prompt_logprobs:
            sampled = set(runner_output.req_ids)
            for req_id, entries in prompt_logprobs.items():
                req = requests.get(req_id)
                if req_id in sampled or req is None:
                    continue
                outputs.append(EngineCoreOutput(req_id=req_id, new_token_ids=[], new_prompt_logprobs=entries,
                                                num_cached_tokens=req.num_cached_tokens))
        if any_finished:
            self.running = [r for r in self.running if r.status is _RUNNING]
        return outputs

    def _fail_requests(self, failed: dict[str, str], outputs: list[EngineCoreOutput]) -> None:
        for req_id, message in failed.items():
            req = self.requests.get(req_id)
            if req is None:
                continue  # aborted while the step ran
            outputs.append(EngineCoreOutput(req_id=req_id, new_token_ids=[], finish_reason="error", error=message,
                                            num_cached_tokens=req.num_cached_tokens))
            self.finish_requests([req_id], RequestStatus.FINISHED_ERROR)

    # -- stats -----------------------------------------------------------------------------------
    def make_stats(self, consume: bool = True) -> SchedulerStats:
        """Gauges now; counters since the previous consuming call (`consume=False` peeks: a live view
        for health checks and tests that leaves the counters to the per-step stats)."""
        return self._stats.make(self, consume)

    def reset_prefix_cache(self) -> bool:
        """Forgets every cached block; False (nothing done) while any request holds blocks."""
        return self.kv_cache_manager.reset_prefix_cache()

