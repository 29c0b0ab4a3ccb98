"""How prefills share a step: a long prompt cannot starve short ones when prefill chunks are capped and
several partial prefills may run (`--max-num-partial-prefills`, `--max-long-partial-prefills`,
`--long-prefill-token-threshold`), and `--scheduler-delay-factor` holds new prompts back while
requests run. Simulated steps, no torch."""

from __future__ import annotations

import pytest

from aserve.config import CacheConfig, EngineArgs, KVCacheInfo, SchedulerConfig
from aserve.core.batch import RunnerOutput
from aserve.core.prefill_limits import PrefillLimits
from aserve.core.request import Request
from aserve.core.scheduler import Scheduler
from aserve.sampling_params import SamplingParams


def _scheduler(clock=None, **limits) -> Scheduler:
    config = SchedulerConfig(max_num_batched_tokens=256, max_num_seqs=16, max_model_len=4096, **limits)
    return Scheduler(config, CacheConfig(enable_prefix_caching=False),
                     KVCacheInfo(num_blocks=1024, num_cpu_blocks=0, block_size=16),
                     prefill_limits=PrefillLimits(config, clock) if clock else None)


def _req(rid: str, n: int, arrival: float = 0.0) -> Request:
    return Request(rid, list(range(1, n + 1)), SamplingParams(max_tokens=4, ignore_eos=True), arrival_time=arrival)


def _run_until_first_tokens(sched: Scheduler, ids: list[str], max_steps: int = 50) -> dict[str, int]:
    """Steps until each request samples its first token (its TTFT in steps)."""
    first: dict[str, int] = {}
    for step in range(1, max_steps + 1):
        so = sched.schedule()
        sampled = [r for r, n in zip(so.scheduled_req_ids, so.num_scheduled_tokens)
                   if sched.get_request(r).num_computed_tokens >= sched.get_request(r).num_tokens]
        sched.update(so, RunnerOutput(req_ids=sampled, sampled_token_ids=[[7]] * len(sampled), logprobs=[]))
        for r in sampled:
            first.setdefault(r, step)
        if all(r in first for r in ids):
            return first
    raise AssertionError(f"not every request started: {first}")


def _long_then_short(sched: Scheduler) -> list[str]:
    sched.add_request(_req("long", 2000))
    for i in range(6):
        sched.add_request(_req(f"short{i}", 20))
    return ["long"] + [f"short{i}" for i in range(6)]


def test_by_default_a_long_prompt_holds_the_step_budget():
    first = _run_until_first_tokens(s := _scheduler(), _long_then_short(s))
    assert first["long"] == 8 and min(first[f"short{i}"] for i in range(6)) >= 8  # they wait for all 2000 tokens


def test_capped_chunks_and_partial_prefills_keep_short_prompts_moving():
    sched = _scheduler(max_num_partial_prefills=4, max_long_partial_prefills=1, long_prefill_token_threshold=128)
    first = _run_until_first_tokens(sched, _long_then_short(sched))
    assert max(first[f"short{i}"] for i in range(6)) <= 2  # bounded TTFT: they share the first steps
    assert first["long"] >= 16  # 128-token chunks: the long prompt still finishes


def test_only_max_long_partial_prefills_long_prompts_prefill_at_once():
    sched = _scheduler(max_num_partial_prefills=3, max_long_partial_prefills=1, long_prefill_token_threshold=64)
    for i in range(3):
        sched.add_request(_req(f"long{i}", 500))
    so = sched.schedule()
    assert so.scheduled_req_ids == ["long0"] and so.num_scheduled_tokens == [64]  # the others wait their turn


def test_delay_factor_holds_new_prompts_while_requests_run():
    now = [100.0]
    sched = _scheduler(clock=lambda: now[0], scheduler_delay_factor=2.0)
    sched.add_request(_req("a", 100, arrival=100.0))
    so = sched.schedule()  # nothing runs: admitted at once
    now[0] += 0.5  # the prompt step took 0.5 s
    sched.update(so, RunnerOutput(req_ids=["a"], sampled_token_ids=[[7]], logprobs=[]))
    sched.add_request(_req("b", 10, arrival=now[0]))
    so = sched.schedule()  # "a" decodes; "b" waited 0 s < 2 x 0.5 s
    assert so.scheduled_req_ids == ["a"]
    sched.update(so, RunnerOutput(req_ids=["a"], sampled_token_ids=[[7]], logprobs=[]))
    now[0] += 1.1
    assert "b" in sched.schedule().scheduled_req_ids  # waited 1.1 s > 1.0 s


@pytest.mark.parametrize(("kwargs", "flag"), [
    ({"max_num_partial_prefills": 0}, "--max-num-partial-prefills"),
    ({"max_num_partial_prefills": 2, "max_long_partial_prefills": 3}, "--max-long-partial-prefills"),
    ({"long_prefill_token_threshold": -1}, "--long-prefill-token-threshold"),
    ({"scheduler_delay_factor": -0.5}, "--scheduler-delay-factor"),
])
def test_bad_values_are_refused_naming_the_flag(kwargs, flag):
    from aserve.config import ConfigError

    with pytest.raises(ConfigError, match=flag):
        EngineArgs(**kwargs).validate()


def test_threshold_defaults_to_four_percent_of_the_context_with_partial_prefills(tmp_path):
    import json

    (tmp_path / "config.json").write_text(json.dumps({
        "architectures": ["LlamaForCausalLM"], "vocab_size": 100, "hidden_size": 64, "intermediate_size": 128,
        "num_hidden_layers": 2, "num_attention_heads": 4, "max_position_embeddings": 1000}))
    cfg = EngineArgs(model=str(tmp_path), max_num_partial_prefills=2).create_config()
    assert cfg.scheduler.long_prefill_token_threshold == 40
    assert EngineArgs(model=str(tmp_path)).create_config().scheduler.long_prefill_token_threshold == 0
