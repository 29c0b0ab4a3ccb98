"""AsyncEngine on the event loop: streams, overlap on/off, abort frees blocks, worker death fails requests."""

from __future__ import annotations

import os
import signal

import anyio
import pytest

from aserve.config import EngineArgs
from aserve.engine.async_engine import AsyncEngine, EngineDeadError
from aserve.executor.base import ExecutorDeadError, make_executor
from aserve.sampling_params import RequestOutputKind, SamplingParams

PROMPTS = [[5, 6, 7, 8, 9, 10, 11], [20, 21, 22], list(range(30, 70))]


def _engine(path: str, executors: list | None = None, **kwargs) -> AsyncEngine:
    """The engine (a thread executor unless `distributed_executor_backend` is given; None = the async
    engine's default); the executor it made is appended to `executors` when given."""
    kwargs.setdefault("distributed_executor_backend", "uni")
    args = EngineArgs(model=path, dtype="float32", skip_tokenizer_init=True, max_model_len=256,
                      cpu_kvcache_space=0.02, **kwargs)

    return AsyncEngine.from_engine_args(args, executor_factory=recording_factory(executors))


def recording_factory(executors: list | None):
    """An executor factory that appends each executor it makes to `executors` (when given)."""
    def factory(config):
        executor = make_executor(config)
        if executors is not None:
            executors.append(executor)
        return executor

    return factory


async def _collect(engine: AsyncEngine, req_id: str, prompt: list[int], max_tokens: int) -> list[int]:
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True, detokenize=False,
                            output_kind=RequestOutputKind.DELTA)
    tokens: list[int] = []
    async for out in engine.add_request(req_id, None, prompt, params):
        tokens += out.outputs[0].token_ids if out.outputs else []
    return tokens


def _run_all(path: str, **kwargs) -> dict[str, list[int]]:
    results: dict[str, list[int]] = {}

    async def main():
        engine = _engine(path, **kwargs)
        async with anyio.create_task_group() as tg:
            await tg.start(engine.run)

            async def one(i, p):
                results[str(i)] = await _collect(engine, str(i), p, 10)

            async with anyio.create_task_group() as reqs:
                for i, p in enumerate(PROMPTS):
                    reqs.start_soon(one, i, p)
            engine.shutdown()

    anyio.run(main)
    return results


def test_overlap_and_no_overlap_agree_with_offline(tiny_llama):
    from aserve import LLM

    llm = LLM(tiny_llama, dtype="float32", skip_tokenizer_init=True, max_model_len=256, cpu_kvcache_space=0.02)
    offline = llm.generate([{"prompt_token_ids": p} for p in PROMPTS],
                           SamplingParams(temperature=0, max_tokens=10, ignore_eos=True, detokenize=False),
                           use_tqdm=False)
    expected = {str(i): o.outputs[0].token_ids for i, o in enumerate(offline)}
    assert _run_all(tiny_llama, disable_async_output_proc=False) == expected  # overlapped (on CPU, on request)
    assert _run_all(tiny_llama) == expected  # on CPU, not overlapped by default


def test_abort_frees_blocks_within_a_step(tiny_llama):
    async def main():
        engine = _engine(tiny_llama)
        async with anyio.create_task_group() as tg:
            await tg.start(engine.run)
            params = SamplingParams(temperature=0, max_tokens=200, ignore_eos=True, detokenize=False,
                                    output_kind=RequestOutputKind.DELTA)
            stream = engine.add_request("long", None, PROMPTS[2], params)
            got = 0
            async for out in stream:
                got += len(out.outputs[0].token_ids) if out.outputs else 0
                if got >= 3:
                    break
            assert engine.get_scheduler_stats().num_used_blocks > 0
            await engine.abort("long")
            # The scheduler freed the blocks in the abort call itself, before any further step.
            assert engine.get_scheduler_stats().num_used_blocks == 0
            final = await stream.__anext__()
            assert final.finished and final.outputs[0].finish_reason == "abort"
            engine.shutdown()

    anyio.run(main)


def test_worker_death_fails_requests_and_health(tiny_llama):
    """Also: without an explicit backend the async engine runs the model in a worker process."""
    async def main():
        executors: list = []
        engine = _engine(tiny_llama, executors, distributed_executor_backend=None)
        assert engine.config.parallel.distributed_executor_backend == "mp"
        pid = executors[0].pid
        # the engine loop re-raises the executor's error, failing its task group
        with pytest.RaisesGroup(ExecutorDeadError):
            async with anyio.create_task_group() as tg:
                await tg.start(engine.run)
                params = SamplingParams(temperature=0, max_tokens=240 - len(PROMPTS[0]), ignore_eos=True,
                                        detokenize=False, output_kind=RequestOutputKind.DELTA)
                stream = engine.add_request("r", None, PROMPTS[0], params)
                await stream.__anext__()
                os.kill(pid, signal.SIGKILL)
                with pytest.raises(EngineDeadError):
                    async for _ in stream:
                        pass
        assert isinstance(engine.dead_error, ExecutorDeadError), engine.dead_error
        assert not engine.is_healthy()
        with pytest.raises(EngineDeadError):
            await engine.check_health()
        with pytest.raises(EngineDeadError):
            engine.add_request("late", None, PROMPTS[1], SamplingParams(max_tokens=2))

    anyio.run(main)
