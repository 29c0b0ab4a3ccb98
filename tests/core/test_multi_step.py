"""Multi-step decode on the scheduler's side (core/multi_step.py, core/scheduler.py), no torch.

A fake runner runs a multi-step call as the real one does: the first step as any step, then each
request's further decode steps, each writing the KV of the token sampled before it into the slots
the scheduler reserved (the fake checks every position it reads holds the right prefix, so a slot
outside the reserved blocks or a cached block overwritten is caught). Outputs must equal the
single-step reference, delivered whole or step by step (streamed).
"""

from __future__ import annotations

import pytest

from aserve.config import CacheConfig, KVCacheInfo, SchedulerConfig
from aserve.core.batch import RunnerOutput, SchedulerOutput, TokenLogprobs
from aserve.core.scheduler import Scheduler
from tests.core.core_fakes import FakeRunner, make_request, reference_outputs


def make_multi_step_scheduler(num_steps: int, *, num_blocks: int = 64, block_size: int = 4,
                              max_num_batched_tokens: int = 64, max_num_seqs: int = 8, max_model_len: int = 64,
                              enable_prefix_caching: bool = True, preemption_mode: str = "recompute",
                              num_cpu_blocks: int = 0) -> Scheduler:
    return Scheduler(
        SchedulerConfig(max_num_batched_tokens=max_num_batched_tokens, max_num_seqs=max_num_seqs,
                        max_model_len=max_model_len, preemption_mode=preemption_mode,
                        num_scheduler_steps=num_steps),
        CacheConfig(block_size=block_size, enable_prefix_caching=enable_prefix_caching),
        KVCacheInfo(num_blocks=num_blocks, num_cpu_blocks=num_cpu_blocks, block_size=block_size))


class MultiStepFakeRunner(FakeRunner):
    """FakeRunner plus the later decode steps of a multi-step call (`streamed`: each step its own
    output, as with `on_progress`, returned as a list)."""

    def __init__(self, block_size: int, streamed: bool = False):
        super().__init__(block_size)
        self.streamed = streamed
        self.num_calls = 0
        self.num_multi_step_calls = 0

    def execute_call(self, so: SchedulerOutput) -> list[RunnerOutput]:
        self.num_calls += 1
        first = self.execute(so)
        if not so.decode_steps:
            return [first]
        self.num_multi_step_calls += 1
        assert set(so.decode_steps) == set(so.scheduled_req_ids)
        assert all(n == 1 for n in so.num_scheduled_tokens)
        steps = [first]
        for k in range(1, max(so.decode_steps.values())):
            active = [r for r in steps[-1].req_ids if so.decode_steps[r] > k]
            if not active:
                break
            steps.append(self._decode(active, k))
        if self.streamed:
            return steps
        tokens = {r: [] for r in first.req_ids}
        logprobs = {r: [] for r in first.req_ids}
        for step in steps:
            for r, t, lp in zip(step.req_ids, step.sampled_token_ids, step.logprobs):
                tokens[r] += t
                logprobs[r] += lp
        return [RunnerOutput(req_ids=first.req_ids, sampled_token_ids=[tokens[r] for r in first.req_ids],
                             logprobs=[logprobs[r] for r in first.req_ids])]

    def _decode(self, req_ids: list[str], step: int) -> RunnerOutput:
        bs = self.block_size
        sampled, logprobs = [], []
        for req_id in req_ids:
            st = self.reqs[req_id]
            pos = st.num_computed
            assert pos == len(st.tokens) - 1
            assert len(st.block_ids) * bs > pos, f"{req_id}: no reserved slot for position {pos}"
            self.kv[(st.block_ids[pos // bs], pos % bs)] = st.fingerprint(pos)
            for p in range(pos + 1):
                assert self.kv.get((st.block_ids[p // bs], p % bs)) == st.fingerprint(p), f"{req_id}: KV at {p}"
            st.num_computed = pos + 1
            token = self.token_fn(st.tokens)
            st.tokens.append(token)
            sampled.append([token])
            logprobs.append([TokenLogprobs([token], [-0.5], [1])] if st.params.logprobs is not None else [])
        return RunnerOutput(req_ids=list(req_ids), sampled_token_ids=sampled, logprobs=logprobs, decode_step=step)


def run(sched: Scheduler, runner: MultiStepFakeRunner, max_calls: int = 500):
    tokens: dict[str, list[int]] = {}
    reasons: dict[str, str] = {}
    for _ in range(max_calls):
        if not sched.has_unfinished_requests():
            return tokens, reasons
        so = sched.schedule()
        for out in runner.execute_call(so):
            for o in sched.update(so, out):
                tokens.setdefault(o.req_id, []).extend(o.new_token_ids)
                assert len(o.new_logprobs) in (0, len(o.new_token_ids))
                if o.finish_reason is not None:
                    reasons[o.req_id] = o.finish_reason
    raise AssertionError("not finished")


def _requests(max_model_len: int):
    """Mixed lengths, limits, EOS and logprobs; one runs into max_model_len."""
    reqs = []
    for i in range(10):
        prompt_len = 3 + (i * 7) % 13
        eos = (reference_outputs(list(range(prompt_len)), 20, max_model_len)[5],) if i % 3 == 0 else ()
        reqs.append((f"r{i}", prompt_len, 1 + (i * 5) % 17, eos, {"logprobs": 1} if i % 4 == 1 else {}))
    reqs.append(("long", max_model_len - 6, 50, (), {}))
    return reqs


@pytest.mark.parametrize("streamed", [False, True])
@pytest.mark.parametrize("num_blocks,preemption_mode", [(64, "recompute"), (14, "recompute"), (14, "swap")])
def test_multi_step_outputs_equal_the_single_step_reference(streamed, num_blocks, preemption_mode):
    max_model_len = 40
    sched = make_multi_step_scheduler(4, num_blocks=num_blocks, max_model_len=max_model_len,
                                      preemption_mode=preemption_mode,
                                      num_cpu_blocks=32 if preemption_mode == "swap" else 0)
    runner = MultiStepFakeRunner(sched.block_size, streamed=streamed)
    want = {}
    for req_id, prompt_len, max_tokens, eos, params in _requests(max_model_len):
        prompt = list(range(prompt_len))
        sched.add_request(make_request(req_id, prompt, max_tokens=max_tokens, eos=eos, **params))
        want[req_id] = reference_outputs(prompt, max_tokens, max_model_len, eos)
    tokens, reasons = run(sched, runner)
    assert tokens == want
    assert reasons["long"] == "length" and len(tokens["long"]) == 6
    assert runner.num_multi_step_calls > 0
    assert (sched.num_preemptions > 0) == (num_blocks == 14)  # the small cache preempts
    assert sched.kv_cache_manager.pool.num_free_blocks == num_blocks - 1  # every block back


def test_multi_step_takes_fewer_calls_and_only_when_every_request_decodes():
    sched = make_multi_step_scheduler(8)
    sched.add_request(make_request("a", 5, max_tokens=20))
    so = sched.schedule()  # the prompt: one step
    assert so.decode_steps == {}
    runner = MultiStepFakeRunner(sched.block_size)
    sched.update(so, runner.execute_call(so)[0])
    so = sched.schedule()  # a decode: up to 8 steps
    assert so.decode_steps == {"a": 8}
    for out in runner.execute_call(so):
        sched.update(so, out)
    assert len(sched.get_request("a").output_token_ids) == 9
    sched.add_request(make_request("b", 6, max_tokens=3))
    so = sched.schedule()  # a prompt joins: one step for everyone
    assert so.decode_steps == {} and set(so.scheduled_req_ids) == {"a", "b"}
    for out in runner.execute_call(so):
        sched.update(so, out)
    so = sched.schedule()  # b may produce 2 more tokens (max_tokens 3), a the full 8 (10 left)
    assert so.decode_steps == {"a": 8, "b": 2}


def test_counts_stop_at_max_tokens_and_max_model_len_and_slots_are_reserved():
    sched = make_multi_step_scheduler(16, max_model_len=20, block_size=4)
    sched.add_request(make_request("a", 10, max_tokens=100))
    sched.add_request(make_request("b", 4, max_tokens=6))
    runner = MultiStepFakeRunner(sched.block_size)
    so = sched.schedule()
    for out in runner.execute_call(so):
        sched.update(so, out)
    so = sched.schedule()
    # a: 11 tokens, at most 20 -> 9 more; b: 1 of 6 produced -> 5 more
    assert so.decode_steps == {"a": 9, "b": 5}
    kv = sched.kv_cache_manager
    assert len(kv.get_block_ids("a")) * 4 >= 11 + 9 - 1
    assert len(kv.get_block_ids("b")) * 4 >= 5 + 5 - 1


def test_one_step_setting_never_plans_multi_step():
    sched = make_multi_step_scheduler(1)
    sched.add_request(make_request("a", 5, max_tokens=10))
    runner = MultiStepFakeRunner(sched.block_size)
    tokens, _ = run(sched, runner)
    assert runner.num_multi_step_calls == 0 and runner.num_calls == 10
    assert tokens["a"] == reference_outputs(list(make_request("a", 5).prompt_token_ids), 10, 64)
