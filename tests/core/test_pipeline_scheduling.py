"""Pipeline parallelism on the scheduler's side (`SchedulerConfig.max_steps_in_flight`), no torch.

Two steps are kept in flight, as the engine does with two stages: the second is scheduled before the
first's output is applied. The fake runner plays a first stage: it runs each step when it is collected
(in submission order, as the workers do) and never keeps the tokens it samples, so a decode step's
input must come from `CachedRequestData.new_token_ids`. Outputs must equal the undisturbed reference,
under chunked prefill, prefix caching and preemption; a request is never in two steps in flight, nor
preempted while in one.
"""

from __future__ import annotations

from collections import deque

import pytest

from aserve.config import CacheConfig, KVCacheInfo, SchedulerConfig
from aserve.core.batch import RunnerOutput, SchedulerOutput
from aserve.core.scheduler import Scheduler
from tests.core.core_fakes import FakeRunner, make_request, reference_outputs


class FirstStageFakeRunner(FakeRunner):
    """Knows a request's tokens only from the scheduler: new requests' token ids and each step's
    `new_token_ids` (what it samples is forgotten, as a first stage never samples)."""

    def execute(self, so: SchedulerOutput) -> RunnerOutput:
        for cached in so.cached_requests:
            st = self.reqs[cached.req_id]
            start = cached.num_computed_tokens
            st.tokens[start:start + len(cached.new_token_ids)] = cached.new_token_ids
        out = super().execute(so)
        for req_id in out.req_ids:
            self.reqs[req_id].tokens.pop()
        return out


def make_pipelined_scheduler(num_blocks: int, max_num_batched_tokens: int = 32) -> Scheduler:
    return Scheduler(
        SchedulerConfig(max_num_batched_tokens=max_num_batched_tokens, max_num_seqs=8, max_model_len=64,
                        max_steps_in_flight=2),
        CacheConfig(block_size=4, enable_prefix_caching=True),
        KVCacheInfo(num_blocks=num_blocks, num_cpu_blocks=0, block_size=4))


def run_pipelined(scheduler: Scheduler, runner: FakeRunner, depth: int = 2) -> tuple[dict[str, list[int]], int]:
    """Drives the scheduler with up to `depth` steps in flight; (tokens per request, steps that ran while
    another with requests was in flight)."""
    tokens: dict[str, list[int]] = {}
    steps: deque[SchedulerOutput] = deque()
    overlapped = 0
    for _ in range(2000):
        if not scheduler.has_unfinished_requests() and not steps:
            return tokens, overlapped
        while len(steps) < depth:
            so = scheduler.schedule()
            if not so.needs_runner:
                break
            busy = {r for step in steps for r in step.scheduled_req_ids}
            assert not busy & set(so.scheduled_req_ids), "a request scheduled in two steps in flight"
            preempted = {r for r in so.finished_req_ids if r in scheduler.requests}
            assert not busy & preempted, "a request preempted while its step was in flight"
            overlapped += bool(busy and so.scheduled_req_ids)
            steps.append(so)
        so = steps.popleft()
        for out in scheduler.update(so, runner.execute(so)):
            tokens.setdefault(out.req_id, []).extend(out.new_token_ids)
    raise AssertionError("not finished")


@pytest.mark.parametrize("num_blocks", [64, 14])  # 14: too few for the batch, so requests are preempted
def test_two_steps_in_flight_give_the_reference_outputs(num_blocks):
    scheduler = make_pipelined_scheduler(num_blocks, max_num_batched_tokens=12)
    shared = [3, 1, 4, 1, 5, 9, 2, 6]
    prompts = {f"r{i}": (shared + [i, i + 1, i + 2] * (i % 3 + 1)) for i in range(6)}
    for req_id, prompt in prompts.items():
        scheduler.add_request(make_request(req_id, prompt, max_tokens=10))
    tokens, overlapped = run_pipelined(scheduler, FirstStageFakeRunner(4))
    assert tokens == {r: reference_outputs(p, 10, 64) for r, p in prompts.items()}
    assert overlapped > 10  # the two steps really overlapped
    if num_blocks == 14:
        assert scheduler.num_preemptions > 0


def test_running_requests_are_shared_between_the_steps_in_flight():
    scheduler = make_pipelined_scheduler(64)
    for i in range(5):
        scheduler.add_request(make_request(f"r{i}", 3, max_tokens=20))
    runner = FirstStageFakeRunner(4)
    admit = scheduler.schedule()  # all five prompts in one step
    scheduler.update(admit, runner.execute(admit))
    first, second = scheduler.schedule(), scheduler.schedule()
    assert len(first.scheduled_req_ids) == 3 and len(second.scheduled_req_ids) == 2
    scheduler.update(first, runner.execute(first))
    third = scheduler.schedule()  # the first micro-batch again, while the second is in flight
    assert third.scheduled_req_ids == first.scheduled_req_ids


def test_decode_steps_carry_the_sampled_token_and_prefill_chunks_do_not():
    scheduler = make_pipelined_scheduler(64, max_num_batched_tokens=8)
    scheduler.add_request(make_request("a", 12, max_tokens=3))
    first = scheduler.schedule()  # prompt tokens 0..7
    assert scheduler.schedule().is_empty  # "a" is in flight: nothing else to run
    runner = FirstStageFakeRunner(4)
    scheduler.update(first, runner.execute(first))
    second = scheduler.schedule()  # prompt tokens 8..11: samples the first output
    assert second.cached_requests[0].new_token_ids == []
    out = runner.execute(second)
    scheduler.update(second, out)
    third = scheduler.schedule()  # the first decode: its input is the token just sampled
    assert third.cached_requests[0].new_token_ids == out.sampled_token_ids[0]


def test_one_step_in_flight_sends_no_tokens():
    scheduler = Scheduler(SchedulerConfig(max_num_batched_tokens=32, max_num_seqs=8, max_model_len=64),
                          CacheConfig(block_size=4), KVCacheInfo(num_blocks=64, num_cpu_blocks=0, block_size=4))
    scheduler.add_request(make_request("a", 5, max_tokens=3))
    runner = FakeRunner(4)
    so = scheduler.schedule()
    scheduler.update(so, runner.execute(so))
    so = scheduler.schedule()
    assert so.scheduled_req_ids == ["a"] and so.cached_requests[0].new_token_ids == []
