"""Async scheduling on the scheduler's side (`core/steps_in_flight.py`), no torch.

Two steps are kept in flight as the async engine keeps them: step N+1 is scheduled and handed over
before step N's output is applied, and a decoding request runs one token ahead of what the scheduler
knows. The fake runner keeps the tokens it samples (as the real one does), runs each step when it is
collected, in order, and checks every KV position it reads. Outputs must equal the undisturbed
reference under chunked prefill, prefix caching, preemption, EOS and aborts; nothing runs past
`max_tokens`; a request in flight is never preempted; every block comes back.
"""

from __future__ import annotations

from collections import deque

import pytest

from aserve.config import CacheConfig, KVCacheInfo, SchedulerConfig
from aserve.core.batch import SchedulerOutput
from aserve.core.request import RequestStatus
from aserve.core.scheduler import Scheduler
from tests.core.core_fakes import FakeRunner, make_request, next_token, reference_outputs

MAX_MODEL_LEN = 64


def make_async_scheduler(num_blocks: int, max_num_batched_tokens: int = 32, max_num_seqs: int = 8) -> Scheduler:
    return Scheduler(
        SchedulerConfig(max_num_batched_tokens=max_num_batched_tokens, max_num_seqs=max_num_seqs,
                        max_model_len=MAX_MODEL_LEN, max_steps_in_flight=2, async_scheduling=True),
        CacheConfig(block_size=4, enable_prefix_caching=True),
        KVCacheInfo(num_blocks=num_blocks, num_cpu_blocks=0, block_size=4))


class Drive:
    """Runs the scheduler with two steps in flight, checking the protocol at every step."""

    def __init__(self, scheduler: Scheduler, runner: FakeRunner):
        self.scheduler, self.runner = scheduler, runner
        self.tokens: dict[str, list[int]] = {}
        self.finish: dict[str, str | None] = {}
        self.steps: deque[SchedulerOutput] = deque()
        self.ahead = 0  # steps that scheduled a request whose previous step was still in flight
        self.computed: dict[str, int] = {}  # tokens the runner computed per request

    def submit(self) -> bool:
        so = self.scheduler.schedule()
        if not so.needs_runner:
            return False
        busy = {r for step in self.steps for r in step.scheduled_req_ids}
        preempted = {r for r in so.finished_req_ids if r in self.scheduler.requests}
        assert not busy & preempted, "a request preempted while its step was in flight"
        self.ahead += bool(busy & set(so.scheduled_req_ids))
        for req_id, n in zip(so.scheduled_req_ids, so.num_scheduled_tokens):
            self.computed[req_id] = self.computed.get(req_id, 0) + n
        self.steps.append(so)
        return True

    def collect(self) -> None:
        so = self.steps.popleft()
        for out in self.scheduler.update(so, self.runner.execute(so)):
            self.tokens.setdefault(out.req_id, []).extend(out.new_token_ids)
            self.finish[out.req_id] = out.finish_reason

    def run(self) -> None:
        for _ in range(3000):
            if not self.scheduler.has_unfinished_requests() and not self.steps:
                return
            while len(self.steps) < 2 and self.submit():
                pass
            if self.steps:
                self.collect()
        raise AssertionError("not finished")


PROMPTS = {f"r{i}": [3, 1, 4, 1, 5, 9, 2, 6] + [i, i + 1, i + 2] * (i % 3 + 1) for i in range(6)}


@pytest.mark.parametrize("num_blocks", [64, 14])  # 14: too few for the batch, so requests are preempted
def test_two_steps_in_flight_with_requests_ahead_give_the_reference_outputs(num_blocks):
    scheduler = make_async_scheduler(num_blocks, max_num_batched_tokens=12)
    max_tokens = {r: 4 + 3 * i for i, r in enumerate(PROMPTS)}
    for req_id, prompt in PROMPTS.items():
        scheduler.add_request(make_request(req_id, prompt, max_tokens=max_tokens[req_id]))
    drive = Drive(scheduler, FakeRunner(4))
    drive.run()
    assert drive.tokens == {r: reference_outputs(p, max_tokens[r], MAX_MODEL_LEN) for r, p in PROMPTS.items()}
    assert drive.ahead > 10  # requests really ran a step ahead
    if num_blocks == 64:  # never a token past max_tokens (with no preemption recomputing any)
        for req_id, prompt in PROMPTS.items():
            assert drive.computed[req_id] <= len(prompt) + max_tokens[req_id] - 1
    assert scheduler.kv_cache_manager.num_free_blocks == num_blocks - 1


def test_a_request_that_stops_has_its_ahead_token_dropped_and_its_blocks_freed():
    prompt = PROMPTS["r1"]
    eos = reference_outputs(prompt, 20, MAX_MODEL_LEN)[5]  # its sixth token is its EOS
    scheduler = make_async_scheduler(64)
    scheduler.add_request(make_request("stops", prompt, max_tokens=20, eos=(eos,)))
    scheduler.add_request(make_request("goes", PROMPTS["r2"], max_tokens=12))
    drive = Drive(scheduler, FakeRunner(4))
    drive.run()
    assert drive.tokens["stops"] == reference_outputs(prompt, 20, MAX_MODEL_LEN, eos=(eos,))
    assert drive.finish["stops"] == "stop"
    assert drive.tokens["goes"] == reference_outputs(PROMPTS["r2"], 12, MAX_MODEL_LEN)
    # the step after the EOS token was already in flight: one token computed and dropped
    assert drive.computed["stops"] == len(prompt) + len(drive.tokens["stops"])  # not len(...) - 1
    assert scheduler.kv_cache_manager.num_free_blocks == 63


def test_an_abort_with_two_steps_in_flight_frees_the_blocks_at_once():
    scheduler = make_async_scheduler(64)
    scheduler.add_request(make_request("aborted", PROMPTS["r0"], max_tokens=30))
    scheduler.add_request(make_request("kept", PROMPTS["r3"], max_tokens=8))
    drive = Drive(scheduler, FakeRunner(4))
    for _ in range(3):  # a few tokens in
        while len(drive.steps) < 2 and drive.submit():
            pass
        drive.collect()
    assert any("aborted" in so.scheduled_req_ids for so in drive.steps)
    scheduler.abort_requests("aborted")
    assert "aborted" not in scheduler.kv_cache_manager._blocks  # freed now, while its steps are in flight
    drive.run()
    assert drive.finish.get("aborted") is None  # nothing of it after the abort
    assert drive.tokens["kept"] == reference_outputs(PROMPTS["r3"], 8, MAX_MODEL_LEN)
    assert scheduler.kv_cache_manager.num_free_blocks == 63


def test_an_ahead_decode_waits_for_a_block_instead_of_preempting():
    scheduler = make_async_scheduler(num_blocks=7)  # 6 usable blocks of 4 tokens
    scheduler.add_request(make_request("a", [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11], max_tokens=6))
    scheduler.add_request(make_request("b", [9, 8, 7, 6, 5, 4, 3, 2, 1, 7, 7], max_tokens=6))
    drive = Drive(scheduler, FakeRunner(4))
    drive.run()
    assert drive.tokens["a"] == reference_outputs([1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11], 6, MAX_MODEL_LEN)
    assert drive.tokens["b"] == reference_outputs([9, 8, 7, 6, 5, 4, 3, 2, 1, 7, 7], 6, MAX_MODEL_LEN)
    assert scheduler.kv_cache_manager.num_free_blocks == 6


def test_the_ahead_token_is_a_placeholder_until_its_step_comes_back():
    scheduler = make_async_scheduler(64)
    req = make_request("r", [5, 6, 7], max_tokens=3)
    scheduler.add_request(req)
    runner = FakeRunner(4)
    first = scheduler.schedule()  # the prompt; samples the first token
    second = scheduler.schedule()  # that token's decode, scheduled before it is known
    assert second.scheduled_req_ids == ["r"] and second.num_scheduled_tokens == [1]
    assert second.cached_requests[0].new_token_ids == []  # the runner supplies it
    assert (req.num_computed_tokens, req.num_output_placeholders, req.num_tokens) == (4, 2, 3)
    scheduler.update(first, runner.execute(first))
    assert (req.num_output_placeholders, req.output_token_ids) == (1, [next_token([5, 6, 7])])
    third = scheduler.schedule()  # the last token allowed: max_tokens 3
    assert third.num_scheduled_tokens == [1]
    scheduler.update(second, runner.execute(second))
    assert not scheduler.schedule().needs_runner  # no step past max_tokens
    scheduler.update(third, runner.execute(third))
    assert req.status == RequestStatus.FINISHED_LENGTH_CAPPED
    assert req.output_token_ids == reference_outputs([5, 6, 7], 3, MAX_MODEL_LEN)


def test_under_memory_pressure_the_latest_request_is_preempted_not_the_oldest():
    """Requests in flight are never preempted, and with async scheduling nearly every running request
    is: a request running ahead that finds no block stops the others from running ahead, so the one the
    policy picks (fcfs: the latest admitted) is preemptible when the next step is scheduled. Here the
    oldest needs a block first, with the pool full; running the newer one ahead instead would leave the
    oldest as the only request out of flight, preempting itself."""
    scheduler = make_async_scheduler(num_blocks=4)  # 3 usable blocks of 4 tokens
    prompts = {"oldest": [1, 2, 3, 4], "newest": [5, 6, 7, 8, 9, 10]}  # 1 + 2 blocks: the pool is full
    for req_id, prompt in prompts.items():
        scheduler.add_request(make_request(req_id, prompt, max_tokens=6))
    drive = Drive(scheduler, FakeRunner(4))
    preempted: list[str] = []
    original = drive.submit

    def submit() -> bool:
        before = set(scheduler.requests)
        ran = original()
        if ran:
            preempted.extend(r for r in drive.steps[-1].finished_req_ids if r in before and r in scheduler.requests)
        return ran

    drive.submit = submit
    drive.run()
    assert drive.tokens == {r: reference_outputs(p, 6, MAX_MODEL_LEN) for r, p in prompts.items()}
    assert preempted and preempted[0] == "newest"


def test_a_chunked_prompt_runs_its_next_chunk_ahead():
    scheduler = make_async_scheduler(64, max_num_batched_tokens=8)
    scheduler.add_request(make_request("decoding", [1, 2, 3], max_tokens=30))
    long_prompt = list(range(3, 43))  # 40 tokens: chunks of at most 7 beside the decode
    drive = Drive(scheduler, FakeRunner(4))
    while len(drive.steps) < 2 and drive.submit():  # the short prompt, then its first decode ahead
        pass
    drive.collect()
    scheduler.add_request(make_request("long", long_prompt, max_tokens=4))
    both_in_flight = 0
    for _ in range(12):
        while len(drive.steps) < 2 and drive.submit():
            pass
        both_in_flight += all("long" in so.scheduled_req_ids for so in drive.steps) and len(drive.steps) == 2
        drive.collect()
    assert both_in_flight >= 3  # consecutive chunks in the two steps in flight, not every other step
    drive.run()
    assert drive.tokens["long"] == reference_outputs(long_prompt, 4, MAX_MODEL_LEN)
    assert drive.tokens["decoding"] == reference_outputs([1, 2, 3], 30, MAX_MODEL_LEN)
