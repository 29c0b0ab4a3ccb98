"""Async scheduling end to end (`--async-scheduling`): the next step is scheduled and handed to the runner
while one runs, each decoding request one token ahead of what the scheduler knows (its input is the
token the runner just sampled). Greedy tokens identical to Hugging Face transformers (fp32, tiny random
weights) through `LLM.generate` on the thread executor and the `mp` worker, under chunked prefill,
prefix caching and preemption; EOS honoured (the token computed past it is dropped); the async engine
serving concurrent streams with two steps in flight; the flags it cannot combine with refused."""

from __future__ import annotations

import anyio
import pytest

from aserve.config import ConfigError, EngineArgs
from aserve.engine.async_engine import AsyncEngine
from aserve.sampling_params import RequestOutputKind, SamplingParams
from tests.e2e.test_hf_equivalence import MAX_NEW, PROMPTS, _generate, _llm
from tests.support.multi_rank import CHUNKED_AND_PREEMPTED, stream_concurrently
from tests.support.tiny_models import hf_greedy


@pytest.fixture(scope="module")
def reference(tiny_llama):
    return hf_greedy(tiny_llama, PROMPTS, MAX_NEW, ignore_eos=True)


def assert_blocks_returned(llm) -> None:
    core = llm.engine.core
    assert core.scheduler.kv_cache_manager.num_free_blocks == core.runner_info.num_blocks - 1


def _counting_submits(llm) -> list[int]:
    """Records, for every step submitted, how many requests were in steps still in flight."""
    core = llm.engine.core
    submitted: list[int] = []
    submit = core.submit

    def counting(so):
        submitted.append(len(set(so.scheduled_req_ids) & {r for s, _ in core._steps_in_flight
                                                          for r in s.scheduled_req_ids}))
        submit(so)

    core.submit = counting
    return submitted


@pytest.mark.timeout(180)
@pytest.mark.parametrize("backend", ["uni", "mp"])
@pytest.mark.parametrize("case", ["chunked_and_preempted", "prefix_caching"])
def test_async_scheduling_matches_hf(tiny_llama, reference, backend, case):
    kwargs = CHUNKED_AND_PREEMPTED if case == "chunked_and_preempted" else dict(enable_prefix_caching=True,
                                                                               block_size=8)
    llm = _llm(tiny_llama, async_scheduling=True, distributed_executor_backend=backend, **kwargs)
    try:
        ahead = _counting_submits(llm)
        assert _generate(llm, PROMPTS) == reference
        assert _generate(llm, PROMPTS[:3]) == reference[:3]  # again: prefix-cache hits, fresh request ids
        assert max(ahead) > 0  # requests were scheduled while their previous step ran
        assert_blocks_returned(llm)
    finally:
        llm.engine.shutdown()


@pytest.mark.timeout(120)
def test_eos_is_honoured_and_max_tokens_never_passed(tiny_llama):
    sync = _llm(tiny_llama)
    params = [SamplingParams(temperature=0.0, max_tokens=1 + i, detokenize=False) for i in range(len(PROMPTS))]
    prompts = [{"prompt_token_ids": p} for p in PROMPTS]
    # each prompt's third greedy token becomes its EOS: generation stops there, in both modes alike
    eos_runs = [o.outputs[0].token_ids for o in sync.generate(prompts, SamplingParams(
        temperature=0.0, max_tokens=3, ignore_eos=True, detokenize=False), use_tqdm=False)]
    stop_params = [SamplingParams(temperature=0.0, max_tokens=MAX_NEW, stop_token_ids=[run[2]], detokenize=False)
                   for run in eos_runs]
    expected = ([o.outputs[0].token_ids for o in sync.generate(prompts, params, use_tqdm=False)],
                [o.outputs[0].token_ids for o in sync.generate(prompts, stop_params, use_tqdm=False)])
    sync.engine.shutdown()
    llm = _llm(tiny_llama, async_scheduling=True)
    try:
        got = ([o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)],
               [o.outputs[0].token_ids for o in llm.generate(prompts, stop_params, use_tqdm=False)])
        assert got == expected
        assert [len(t) for t in got[0]] == [1 + i for i in range(len(PROMPTS))]
        assert all(t[-1] == run[2] for t, run in zip(got[1], eos_runs))
    finally:
        llm.engine.shutdown()


@pytest.mark.timeout(120)
def test_the_async_engine_streams_concurrent_requests_with_requests_ahead(tiny_llama, reference):
    async def main():
        args = EngineArgs(model=tiny_llama, dtype="float32", skip_tokenizer_init=True, max_model_len=256,
                          cpu_kvcache_space=0.02, async_scheduling=True, max_num_seqs=3)
        engine = AsyncEngine.from_engine_args(args)
        assert engine.engine.core._executor.name == "mp"
        assert await stream_concurrently(engine, PROMPTS, MAX_NEW) == reference

    anyio.run(main)


@pytest.mark.parametrize("flag, flags", [
    ("--num-scheduler-steps", dict(num_scheduler_steps=4)),
    ("--pipeline-parallel-size", dict(pipeline_parallel_size=2)),
    ("--speculative-config", dict(speculative_config={"method": "ngram", "num_speculative_tokens": 2,
                                                      "prompt_lookup_max": 3}))])
def test_combinations_not_built_are_refused_naming_both_flags(tiny_llama, flag, flags):
    with pytest.raises(ConfigError, match=f"--async-scheduling: cannot be combined with .*{flag}"):
        EngineArgs(model=tiny_llama, async_scheduling=True, **flags).validate()


@pytest.mark.timeout(120)
def test_a_request_failing_alone_with_its_next_step_in_flight_ends_alone(tiny_llama, reference):
    calls = []

    def fails_on_third_call(output_ids, logits):
        calls.append(len(output_ids))
        if len(calls) == 3:
            raise RuntimeError("processor exploded")
        return logits

    llm = _llm(tiny_llama, async_scheduling=True)
    try:
        ok = SamplingParams(temperature=0.0, max_tokens=MAX_NEW, ignore_eos=True, detokenize=False)
        bad = SamplingParams(temperature=0.0, max_tokens=MAX_NEW, ignore_eos=True, detokenize=False,
                             logits_processors=[fails_on_third_call])
        outs = llm.generate([{"prompt_token_ids": PROMPTS[0]}, {"prompt_token_ids": PROMPTS[1]}], [bad, ok],
                            use_tqdm=False)
        assert outs[0].outputs[0].finish_reason == "error"
        assert outs[0].outputs[0].token_ids == reference[0][:2]
        assert outs[1].outputs[0].token_ids == reference[1]
        assert_blocks_returned(llm)
    finally:
        llm.engine.shutdown()


@pytest.mark.timeout(180)
def test_adapters_load_and_unload_while_a_stream_runs_ahead(tmp_path):
    """Adapter calls go to the worker between steps: with steps in flight the engine stops submitting
    until they are collected (a load meeting a step in the pipe would read that step's reply)."""
    from aserve.lora.request import LoRARequest
    from tests.model.lora._lora_models import save_adapter
    from tests.support.tiny_models import GREEDY_STABLE, save_tiny_hf

    hf = save_tiny_hf(tmp_path / "base", "llama", seed=1234, perturb=True, **GREEDY_STABLE)
    save_adapter(hf, tmp_path / "a1", seed=11)
    reference = hf_greedy(str(tmp_path / "base"), PROMPTS[:2], 40, ignore_eos=True)

    async def main():
        args = EngineArgs(model=str(tmp_path / "base"), dtype="float32", skip_tokenizer_init=True,
                          max_model_len=256, cpu_kvcache_space=0.02, enable_lora=True, max_lora_rank=8)
        engine = AsyncEngine.from_engine_args(args)
        assert engine.engine.core.max_steps_in_flight == 2  # async scheduling, on by default with mp
        params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True, detokenize=False,
                                output_kind=RequestOutputKind.DELTA)
        got: dict[int, list[int]] = {}
        tokens_seen = anyio.Event()

        async def one(i: int) -> None:
            async for out in engine.add_request(f"r{i}", None, PROMPTS[i], params):
                got.setdefault(i, []).extend(out.outputs[0].token_ids)
                if len(got[i]) >= 3:
                    tokens_seen.set()

        async def adapters() -> None:
            await tokens_seen.wait()
            for _ in range(3):
                assert await engine.add_lora(LoRARequest("a1", 1, str(tmp_path / "a1")))
                assert await engine.remove_lora("a1")

        async with anyio.create_task_group() as tg:
            await tg.start(engine.run)
            async with anyio.create_task_group() as work:
                work.start_soon(one, 0)
                work.start_soon(one, 1)
                work.start_soon(adapters)
            engine.shutdown()
        assert engine.dead_error is None
        assert [got[0], got[1]] == reference

    anyio.run(main)
