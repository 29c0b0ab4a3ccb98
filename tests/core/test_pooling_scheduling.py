"""Pooling requests in the scheduler: prefill-only under the token budget (chunked when allowed),
never sampled or decoded, finished with their pooled result in the step their prompt completes, their
blocks freed at once; a request aborted while its step ran is not reported."""

from __future__ import annotations

from aserve.config import CacheConfig, KVCacheInfo, SchedulerConfig
from aserve.core.batch import PooledData, RunnerOutput
from aserve.core.request import Request
from aserve.core.scheduler import Scheduler
from aserve.pooling_params import PoolingParams
from aserve.sampling_params import SamplingParams

VECTOR = PooledData(data=b"\0\0\x80?" * 4, shape=[4])  # [1.0] * 4 in float32


def _scheduler(chunked: bool, budget: int = 16) -> Scheduler:
    return Scheduler(SchedulerConfig(max_num_batched_tokens=budget, max_num_seqs=8, max_model_len=64,
                                     enable_chunked_prefill=chunked),
                     CacheConfig(enable_prefix_caching=False), KVCacheInfo(num_blocks=32, num_cpu_blocks=0, block_size=4))


def _pooling(rid: str, n: int) -> Request:
    return Request(rid, list(range(1, n + 1)), SamplingParams(max_tokens=1), pooling_params=PoolingParams())


def _runner_output(so) -> RunnerOutput:
    """What a pooling runner returns: a vector for each request whose prompt is now complete."""
    done = [r.req_id for r in so.new_requests if r.num_computed_tokens + dict(
        zip(so.scheduled_req_ids, so.num_scheduled_tokens))[r.req_id] >= len(r.prompt_token_ids)]
    return RunnerOutput(req_ids=[], sampled_token_ids=[], logprobs=[], pooled_outputs={r: VECTOR for r in done})


def test_chunked_pooling_request_finishes_when_its_prompt_completes_and_frees_blocks():
    sched = _scheduler(chunked=True, budget=8)
    sched.add_request(_pooling("p", 20))
    steps = []
    while sched.has_unfinished_requests():
        so = sched.schedule()
        steps.append(so.num_scheduled_tokens)
        assert so.new_requests or so.cached_requests
        assert so.new_requests == [] or so.new_requests[0].pooling_params == PoolingParams()
        pooled = {}
        if sched.get_request("p").num_computed_tokens >= 20:
            pooled = {"p": VECTOR}
        outs = sched.update(so, RunnerOutput(req_ids=[], sampled_token_ids=[], logprobs=[], pooled_outputs=pooled))
        if pooled:
            assert [(o.req_id, o.finish_reason, o.pooled, o.new_token_ids) for o in outs] == [("p", "stop", VECTOR, [])]
        else:
            assert outs == []
    assert steps == [[8], [8], [4]]  # prefill only, in chunks; never a decode step
    assert sched.kv_cache_manager.num_used_blocks == 0


def test_whole_prompts_are_batched_under_the_budget_without_chunking():
    sched = _scheduler(chunked=False, budget=16)
    for i, n in enumerate((10, 6, 9)):
        sched.add_request(_pooling(f"p{i}", n))
    so = sched.schedule()
    assert so.scheduled_req_ids == ["p0", "p1"] and so.num_scheduled_tokens == [10, 6]  # p2 waits (no chunk)
    outs = sched.update(so, _runner_output(so))
    assert {o.req_id for o in outs} == {"p0", "p1"} and all(o.finish_reason == "stop" for o in outs)
    so = sched.schedule()
    assert so.scheduled_req_ids == ["p2"] and so.num_scheduled_tokens == [9]
    assert set(so.finished_req_ids) == {"p0", "p1"}  # the runner drops their state
    sched.update(so, _runner_output(so))
    assert not sched.has_unfinished_requests()


def test_request_aborted_during_its_step_is_not_reported():
    sched = _scheduler(chunked=False)
    sched.add_request(_pooling("p", 5))
    so = sched.schedule()
    sched.abort_requests("p")
    assert sched.update(so, _runner_output(so)) == []
    assert sched.kv_cache_manager.num_used_blocks == 0
