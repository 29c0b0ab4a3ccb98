"""Sleep mode below the engine: the runner releases every reference to its KV cache (a draft model's
included) and, at level 2, its weights; waking brings back the same shapes and the same greedy tokens,
part by part with tags. The mp executor carries sleep / wake_up to its worker."""

from __future__ import annotations

import pytest

from aserve.config import EngineArgs
from aserve.core.batch import NewRequestData, SchedulerOutput
from aserve.executor.process import ProcessExecutor
from aserve.runner.factory import make_runner
from aserve.sampling_params import SamplingParams

PROMPT = [5, 6, 7, 8, 9, 10, 11]
GREEDY = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
pytestmark = pytest.mark.timeout(240)


def _step(req_id: str, finished: list[str]) -> SchedulerOutput:
    new = NewRequestData(req_id=req_id, prompt_token_ids=PROMPT, output_token_ids=[], sampling_params=GREEDY,
                         block_ids=[1], num_computed_tokens=0, stop_token_ids_for_min_tokens=[])
    return SchedulerOutput(new_requests=[new], cached_requests=[], scheduled_req_ids=[req_id],
                           num_scheduled_tokens=[len(PROMPT)], finished_req_ids=finished)


def _config(model: str, **kwargs):
    return EngineArgs(model=model, dtype="float32", device="cpu", skip_tokenizer_init=True, max_model_len=64,
                      cpu_kvcache_space=0.01, enforce_eager=True, enable_sleep_mode=True,
                      **kwargs).create_config(model_path=model)


def _bound(model, caches) -> bool:
    return [layer.kv_cache for layer in model.attention_layers] == caches and all(
        layer.kv_cache is cache for layer, cache in zip(model.attention_layers, caches))


def test_runner_releases_and_restores_the_kv_cache_and_weights(tiny_llama):
    runner = make_runner(_config(tiny_llama, speculative_config={"model": tiny_llama, "num_speculative_tokens": 2}))
    runner.load_model()
    runner.initialize_kv_cache()
    runner.capture_graphs()
    tokens = runner.execute(_step("a", [])).sampled_token_ids
    shapes = [tuple(t.shape) for t in runner.kv_caches]
    draft_shapes = [tuple(t.shape) for t in runner.proposer.kv_caches]
    assert draft_shapes  # a draft model with its own cache

    runner.sleep(1)
    assert runner.states == {} and runner.kv_caches == [] and runner.proposer.kv_caches == []
    assert all(layer.kv_cache is None for layer in runner.model.attention_layers)
    assert all(layer.kv_cache is None for layer in runner.proposer.model.attention_layers)
    runner.wake_up()
    assert [tuple(t.shape) for t in runner.kv_caches] == shapes
    assert [tuple(t.shape) for t in runner.proposer.kv_caches] == draft_shapes
    assert _bound(runner.model, runner.kv_caches) and _bound(runner.proposer.model, runner.proposer.kv_caches)
    assert runner.execute(_step("b", ["a"])).sampled_token_ids == tokens

    runner.sleep(2)
    assert runner.model is None and runner.proposer is None and runner.kv_caches == []
    runner.wake_up(("kv_cache",))  # the cache alone: allocated, nothing to bind it to yet
    assert [tuple(t.shape) for t in runner.kv_caches] == shapes and runner.model is None
    assert runner.sleep_state.is_sleeping
    runner.wake_up(("weights",))
    assert not runner.sleep_state.is_sleeping
    assert _bound(runner.model, runner.kv_caches) and _bound(runner.proposer.model, runner.proposer.kv_caches)
    assert runner.execute(_step("c", ["b"])).sampled_token_ids == tokens
    with pytest.raises(ValueError, match="level"):
        runner.sleep(3)


def test_process_executor_carries_sleep_and_wake_up(tiny_llama):
    executor = ProcessExecutor(_config(tiny_llama))
    try:
        executor.start()
        tokens = executor.execute(_step("a", [])).sampled_token_ids
        executor.sleep(2)
        executor.wake_up(("weights",))
        executor.wake_up(None)
        assert executor.execute(_step("b", ["a"])).sampled_token_ids == tokens
        executor.sleep(1)
        executor.wake_up(("kv_cache", "weights"))
        assert executor.execute(_step("c", ["b"])).sampled_token_ids == tokens
    finally:
        executor.shutdown()


@pytest.mark.gpu
def test_cuda_sleep_frees_the_device_cache_and_recaptures_graphs(tiny_llama):
    import torch

    config = EngineArgs(model=tiny_llama, dtype="float32", device="cuda", skip_tokenizer_init=True,
                        max_model_len=64, kv_cache_memory_bytes=256 * 2**20, enable_sleep_mode=True,
                        attention_backend="triton").create_config(model_path=tiny_llama, cuda_available=True)
    runner = make_runner(config)
    runner.load_model()
    runner.initialize_kv_cache()
    runner.capture_graphs()
    tokens = runner.execute(_step("a", [])).sampled_token_ids
    kv_bytes = sum(t.numel() * t.element_size() for t in runner.kv_caches)
    allocated = torch.cuda.memory_allocated()
    weight_bytes = sum(p.numel() * p.element_size() for p in runner.model.parameters())
    runner.sleep(1)
    assert allocated - torch.cuda.memory_allocated() >= kv_bytes + weight_bytes  # weights offloaded too
    assert all(p.device.type == "cpu" for p in runner.model.parameters())
    runner.wake_up()
    assert all(p.device.type == "cuda" for p in runner.model.parameters())
    assert runner.graph_runner is not None  # recaptured against the new cache
    assert runner.execute(_step("b", ["a"])).sampled_token_ids == tokens
