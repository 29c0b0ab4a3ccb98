"""Shared checks of multi-rank engines (tensor and pipeline parallelism): greedy tokens equal to one rank
and to transformers under chunked prefill and preemption, and a rank killed mid-stream failing the
engine at once; and a driver streaming concurrent requests through an async engine with several steps
in flight (pipeline parallelism, async scheduling)."""

from __future__ import annotations

import os
import signal

import anyio
import pytest

from aserve.config import EngineArgs
from aserve.engine.async_engine import AsyncEngine, EngineDeadError
from aserve.executor.base import ExecutorDeadError, make_executor
from aserve.sampling_params import RequestOutputKind, SamplingParams
from tests.e2e.test_hf_equivalence import PROMPTS, _generate, _llm
from tests.support.tiny_models import GREEDY_STABLE, hf_greedy, save_tiny_hf

MAX_NEW = 12
# A 16-token step budget chunks every prompt but the shortest; 17 usable blocks of 8 tokens cannot hold
# the batch, so the scheduler preempts.
CHUNKED_AND_PREEMPTED = dict(enable_chunked_prefill=True, max_num_batched_tokens=16, max_num_seqs=8,
                             num_gpu_blocks_override=18, block_size=8)


def family_model(path: str, family: str | None = None, **overrides) -> tuple[str, list, list]:
    """(folder, HF's greedy tokens, one rank's greedy tokens) for `path`, after saving a tiny random
    `family` model there when given (GREEDY_STABLE weights plus `overrides`)."""
    if family is not None:
        save_tiny_hf(path, family, seed=1234, perturb=True, **{**GREEDY_STABLE, **overrides})
    one_rank = _generate(_llm(path, **CHUNKED_AND_PREEMPTED), PROMPTS)
    return path, hf_greedy(path, PROMPTS, MAX_NEW, ignore_eos=True), one_rank


def check_matches_one_rank(model: tuple[str, list, list], stat_totals, **parallel) -> None:
    """`LLM.generate` with `parallel` ranks (over `mp`) gives one rank's and transformers' tokens, with
    preemptions on the way."""
    path, reference, one_rank = model
    llm = _llm(path, **parallel, **CHUNKED_AND_PREEMPTED)
    try:
        assert llm.engine.config.parallel.distributed_executor_backend == "mp"
        totals = stat_totals(llm)
        got = _generate(llm, PROMPTS)
        assert got == one_rank
        assert got == reference
        assert totals.num_preemptions > 0
    finally:
        llm.engine.shutdown()


def check_killed_rank_fails_the_engine(model: str, prompt: list[int], victim: int, **parallel) -> None:
    """Starts an async engine over `model` with `parallel` (e.g. tensor_parallel_size=2), streams one request,
    SIGKILLs worker rank `victim`: the stream raises EngineDeadError, the engine is dead and unhealthy
    with an ExecutorDeadError naming the rank, and every other rank's process was stopped too."""
    async def main():
        executors: list = []

        def factory(config):
            executors.append(make_executor(config))
            return executors[-1]

        args = EngineArgs(model=model, dtype="float32", skip_tokenizer_init=True, max_model_len=256,
                          cpu_kvcache_space=0.02, **parallel)
        engine = AsyncEngine.from_engine_args(args, executor_factory=factory)
        pids = executors[0].pids
        with anyio.fail_after(60), pytest.RaisesGroup(ExecutorDeadError):
            async with anyio.create_task_group() as tg:
                await tg.start(engine.run)
                params = SamplingParams(temperature=0, max_tokens=200, ignore_eos=True, detokenize=False,
                                        output_kind=RequestOutputKind.DELTA)
                stream = engine.add_request("r", None, prompt, params)
                await stream.__anext__()
                os.kill(pids[victim], signal.SIGKILL)
                with pytest.raises(EngineDeadError):
                    async for _ in stream:
                        pass
        assert isinstance(engine.dead_error, ExecutorDeadError) and f"rank {victim}" in str(engine.dead_error)
        assert not engine.is_healthy()
        executors[0].shutdown()
        for rank, pid in enumerate(pids):
            if rank != victim:  # left blocked in a collective or a send: stopped too
                with pytest.raises(ProcessLookupError):
                    os.kill(pid, 0)

    anyio.run(main)


async def stream_concurrently(engine: AsyncEngine, prompts: list[list[int]], max_tokens: int) -> list[list[int]]:
    """Runs `engine` while every prompt streams at once (greedy, EOS ignored), shuts it down and returns
    each prompt's tokens; asserts every KV block came back."""
    got: dict[int, list[int]] = {}
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True, detokenize=False,
                            output_kind=RequestOutputKind.DELTA)

    async def one(i: int) -> None:
        async for out in engine.add_request(f"r{i}", None, prompts[i], params):
            got.setdefault(i, []).extend(out.outputs[0].token_ids)

    async with anyio.create_task_group() as tg:
        await tg.start(engine.run)
        async with anyio.create_task_group() as requests:
            for i in range(len(prompts)):
                requests.start_soon(one, i)
        engine.shutdown()
    core = engine.engine.core
    assert core.scheduler.kv_cache_manager.num_free_blocks == core.runner_info.num_blocks - 1
    return [got[i] for i in range(len(prompts))]
