"""`--distributed-executor-backend ray` on a local Ray cluster the test starts and stops (4 CPUs, no
dashboard): tensor parallelism over two Ray actors gives one rank's greedy tokens (Llama with tied
embeddings, Qwen2 with biases) under chunked prefill and preemption, and so do two pipeline stages
(two steps in flight through `submit` / `collect`); an actor killed mid-run is
fatal at once; a placement group the cluster cannot satisfy fails the start-up; vLLM's default
backend choice."""

from __future__ import annotations

import time

import pytest

from aserve.config import EngineArgs
from aserve.config.parallel import default_executor_backend
from aserve.core.batch import NewRequestData, SchedulerOutput
from aserve.executor import ray_executor
from aserve.executor.base import ExecutorDeadError
from aserve.sampling_params import SamplingParams
from tests.e2e.test_hf_equivalence import PROMPTS, _generate, _llm
from tests.support.multi_rank import CHUNKED_AND_PREEMPTED

ray = pytest.importorskip("ray")
pytestmark = pytest.mark.timeout(180)


@pytest.fixture(scope="module")
def cluster():
    ray.init(num_cpus=4, include_dashboard=False, log_to_driver=False)
    yield
    ray.shutdown()


@pytest.mark.parametrize("family, split", [("llama", "tp"), ("qwen2", "tp"), ("llama", "pp")])
def test_two_ray_ranks_match_one_rank(cluster, family, split, request, stat_totals):
    path = request.getfixturevalue(f"tiny_{family}")
    one_rank = _generate(_llm(path, **CHUNKED_AND_PREEMPTED), PROMPTS)
    sizes = dict(tensor_parallel_size=2) if split == "tp" else dict(pipeline_parallel_size=2)
    llm = _llm(path, **sizes, distributed_executor_backend="ray", **CHUNKED_AND_PREEMPTED)
    try:
        assert type(llm.engine.core._executor).__name__ == "RayExecutor"
        totals = stat_totals(llm)
        assert _generate(llm, PROMPTS) == one_rank
        assert totals.num_preemptions > 0
    finally:
        llm.engine.shutdown()


def _config(path: str):
    args = EngineArgs(model=path, dtype="float32", skip_tokenizer_init=True, max_model_len=64,
                      cpu_kvcache_space=0.02, tensor_parallel_size=2, distributed_executor_backend="ray")
    return args.create_config(model_path=path)


def test_a_killed_actor_is_fatal_at_once(cluster, tiny_llama):
    executor = ray_executor.RayExecutor(_config(tiny_llama))
    executor.start()
    try:
        ray.kill(executor._actors[1], no_restart=True)
        step = SchedulerOutput([NewRequestData("r", [1, 2, 3], [], SamplingParams(max_tokens=2), [1], 0, [])],
                               [], ["r"], [3], [])
        start = time.monotonic()
        with pytest.raises(ExecutorDeadError, match="Ray rank"):
            executor.execute(step)
        assert time.monotonic() - start < 30  # not rank 0's collective timeout (120 s)
        with pytest.raises(ExecutorDeadError):  # and it stays dead
            executor.execute(step)
    finally:
        executor.shutdown()


def test_an_unplaceable_group_fails_the_start_up(cluster, tiny_llama, monkeypatch):
    monkeypatch.setattr(ray_executor, "_PLACEMENT_TIMEOUT_S", 2.0)
    executor = ray_executor.RayExecutor(_config(tiny_llama))
    executor.world_size = 8  # 8 CPUs asked of a 4-CPU cluster
    with pytest.raises(ExecutorDeadError, match="cannot place 8 ranks"):
        executor.start()
    assert executor._placement_group is None and not executor._actors  # nothing left behind


def test_default_backend_follows_vllm():
    assert default_executor_backend(None, 1, "cpu", None) == "uni"
    assert default_executor_backend(None, 2, "cpu", None) == "mp"
    assert default_executor_backend(None, 4, "cuda", 8) == "mp"
    assert default_executor_backend(None, 16, "cuda", 8) == "ray"  # more ranks than local GPUs, Ray installed
    assert default_executor_backend("mp", 16, "cuda", 8) == "mp"
