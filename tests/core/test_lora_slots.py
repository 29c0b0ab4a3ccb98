"""The scheduler's LoRA admission rule: at most max_loras adapters run at once, a request with no free
slot waits (never fails), and no adapter starves another while base-model requests keep flowing."""

from __future__ import annotations

from aserve.config import CacheConfig, KVCacheInfo, SchedulerConfig
from aserve.core.batch import RunnerOutput
from aserve.core.lora_slots import LoRASlots
from aserve.core.request import Request
from aserve.core.scheduler import Scheduler
from aserve.lora.request import LoRARequest
from aserve.sampling_params import SamplingParams

LORAS = {i: LoRARequest(f"a{i}", i, f"/a{i}") for i in (1, 2, 3)}


def _req(rid: str, lora: int, max_tokens: int = 3) -> Request:
    return Request(rid, [1, 2, 3, 4], SamplingParams(max_tokens=max_tokens, ignore_eos=True),
                   lora_request=LORAS.get(lora))


def test_rule_holds_back_later_adapters_once_one_waits():
    slots = LoRASlots(max_loras=1)
    slots.start_step([_req("r", 1)])
    assert slots.can_admit(_req("x", 1))  # its adapter already runs
    assert slots.can_admit(_req("b", 0))  # base model: no slot needed
    assert not slots.can_admit(_req("y", 2))  # no free slot: waits ...
    assert not slots.can_admit(_req("z", 1))  # ... and adapter 1 is no longer fed, so it drains
    assert slots.can_admit(_req("c", 0))


def test_scheduler_runs_at_most_max_loras_adapters_and_finishes_everyone():
    sched = Scheduler(SchedulerConfig(max_num_batched_tokens=64, max_num_seqs=8, max_model_len=64), CacheConfig(),
                      KVCacheInfo(num_blocks=64, num_cpu_blocks=0, block_size=4), max_loras=2)
    order = [1, 2, 3, 1, 0, 2, 3, 0, 1]
    for i, lora in enumerate(order):
        sched.add_request(_req(f"r{i}", lora, max_tokens=2 + i % 3))
    finished, steps = set(), 0
    while sched.has_unfinished_requests():
        steps += 1
        assert steps < 200
        so = sched.schedule()
        running = {sched.requests[r].lora_int_id for r in so.scheduled_req_ids if r in sched.requests}
        assert len(running - {0}) <= 2
        sampled = [r for r in so.scheduled_req_ids
                   if sched.requests[r].num_computed_tokens >= sched.requests[r].num_tokens]
        outs = sched.update(so, RunnerOutput(req_ids=sampled, sampled_token_ids=[[5]] * len(sampled),
                                             logprobs=[[]] * len(sampled)))
        finished |= {o.req_id for o in outs if o.finish_reason is not None}
    assert finished == {f"r{i}" for i in range(len(order))}
