"""A rank of a multi-rank engine killed mid-stream: the shared check that it fails the engine at once."""

from __future__ import annotations

import os
import signal

import anyio
import pytest

from aserve.config import EngineArgs
from aserve.engine.async_engine import AsyncEngine, EngineDeadError
from aserve.executor.base import ExecutorDeadError, make_executor
from aserve.sampling_params import RequestOutputKind, SamplingParams


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
