"""--data-parallel-size: replicas behind one engine client (engine/data_parallel.py). Concurrent requests
get one replica's greedy outputs; both replicas serve; a prompt sharing a known prefix follows it;
aborts reach the owner; a replica's worker dying fails every in-flight request and health."""

from __future__ import annotations

import os
import signal

import anyio
import pytest

from aserve import LLM
from aserve.config import ConfigError, EngineArgs
from aserve.engine.async_engine import EngineDeadError
from aserve.engine.data_parallel import DataParallelEngine
from aserve.executor.base import ExecutorDeadError
from aserve.sampling_params import RequestOutputKind, SamplingParams
from tests.engine.test_async_engine import recording_factory

SHARED = list(range(40, 72))  # two 16-token blocks
PROMPTS = [SHARED + [5, 6, 7], list(range(100, 130)), SHARED + [9, 1], [3, 4, 5, 6, 7, 8], list(range(200, 219))]


def _engine(path: str, executors: list | None = None, **kwargs) -> DataParallelEngine:
    kwargs.setdefault("distributed_executor_backend", "uni")
    args = EngineArgs(model=path, dtype="float32", skip_tokenizer_init=True, max_model_len=256,
                      cpu_kvcache_space=0.02, data_parallel_size=2, **kwargs)

    return DataParallelEngine.from_engine_args(args, executor_factory=recording_factory(executors))


def _params(max_tokens: int) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True, detokenize=False,
                          output_kind=RequestOutputKind.DELTA)


async def _collect(stream) -> list[int]:
    tokens: list[int] = []
    async for out in stream:
        tokens += out.outputs[0].token_ids if out.outputs else []
    return tokens


def test_replicas_serve_concurrent_requests_with_one_replicas_outputs(tiny_llama):
    llm = LLM(tiny_llama, dtype="float32", skip_tokenizer_init=True, max_model_len=256, cpu_kvcache_space=0.02)
    want = [o.outputs[0].token_ids for o in llm.generate([{"prompt_token_ids": p} for p in PROMPTS],
                                                        _params(12), use_tqdm=False)]
    got: dict[int, list[int]] = {}
    owners: dict[int, int] = {}

    async def main():
        engine = _engine(tiny_llama)
        assert [r.config.parallel.data_parallel_rank for r in engine.replicas] == [0, 1]
        async with anyio.create_task_group() as tg:
            await tg.start(engine.run)

            async def one(i):
                stream = engine.add_request(str(i), None, PROMPTS[i], _params(12))
                owners[i] = engine.replica_of(str(i))
                got[i] = await _collect(stream)

            async with anyio.create_task_group() as reqs:
                for i in range(len(PROMPTS)):
                    reqs.start_soon(one, i)
            assert engine.is_healthy() and engine.get_scheduler_stats().num_running_reqs == 0
            engine.shutdown()

    anyio.run(main)
    assert [got[i] for i in range(len(PROMPTS))] == want
    assert set(owners.values()) == {0, 1}  # both replicas served
    assert owners[2] == owners[0]  # the shared prefix followed its replica


def test_abort_reaches_the_owning_replica_and_frees_its_blocks(tiny_llama):
    async def main():
        engine = _engine(tiny_llama)
        async with anyio.create_task_group() as tg:
            await tg.start(engine.run)
            stream = engine.add_request("long", None, PROMPTS[1], _params(200))
            await stream.__anext__()
            owner = engine.replicas[engine.replica_of("long")]
            assert owner.get_scheduler_stats().num_used_blocks > 0
            await engine.abort("long")
            assert owner.get_scheduler_stats().num_used_blocks == 0 and engine.replica_of("long") is None
            engine.shutdown()

    anyio.run(main)


def test_a_replica_whose_worker_dies_fails_every_request_and_health(tiny_llama):
    async def main():
        executors: list = []
        engine = _engine(tiny_llama, executors, distributed_executor_backend="mp")
        failures = []
        with pytest.RaisesGroup(ExecutorDeadError, flatten_subgroups=True):
            async with anyio.create_task_group() as tg:
                await tg.start(engine.run)
                streams = [engine.add_request(str(i), None, p, _params(200)) for i, p in enumerate(PROMPTS[:4])]
                assert {engine.replica_of(str(i)) for i in range(4)} == {0, 1}
                for stream in streams:
                    await stream.__anext__()
                os.kill(executors[1].pid, signal.SIGKILL)
                for stream in streams:
                    with pytest.raises(EngineDeadError):
                        await _collect(stream)
                    failures.append(stream)
        assert len(failures) == 4  # the other replica's requests too: a dead replica is fatal
        assert not engine.is_healthy()

    anyio.run(main)


def test_the_offline_llm_refuses_replicas(tiny_llama):
    with pytest.raises(ConfigError, match="--data-parallel-size: the offline LLM runs one replica"):
        LLM(tiny_llama, data_parallel_size=2)


def test_loggers_without_replica_views_see_the_gauges_summed():
    from aserve.core.stats import SchedulerStats
    from aserve.engine.data_parallel import SummedGauges

    seen = []

    class Line:
        def record(self, s, it):
            seen.append((s.num_running_reqs, s.num_used_blocks, s.num_total_blocks, s.prefix_cache_hits, it))

    summed = SummedGauges(Line(), 2)
    summed.view(0).record(SchedulerStats(num_running_reqs=3, num_used_blocks=4, num_total_blocks=10,
                                         prefix_cache_hits=7), "a")
    summed.view(1).record(SchedulerStats(num_running_reqs=2, num_used_blocks=1, num_total_blocks=10,
                                         prefix_cache_hits=5), "b")
    summed.view(0).record(SchedulerStats(num_running_reqs=1, num_used_blocks=2, num_total_blocks=10), "c")
    # gauges: replica 0's latest plus replica 1's latest; counters: the recording replica's own delta
    assert seen == [(3, 4, 10, 7, "a"), (5, 5, 20, 5, "b"), (3, 3, 20, 0, "c")]  # replica 1 unseen at first


def test_replicas_must_fit_the_gpus_unless_ray(tiny_llama):
    with pytest.raises(ConfigError, match="--data-parallel-size: 2 replica\\(s\\) x 1 rank\\(s\\) need 2 GPUs"):
        EngineArgs(model=tiny_llama, data_parallel_size=2).create_config(cuda_available=True, num_local_gpus=1)
    config = EngineArgs(model=tiny_llama, data_parallel_size=2, distributed_executor_backend="ray").create_config(
        cuda_available=True, num_local_gpus=1)
    assert config.parallel.distributed_executor_backend == "ray"
