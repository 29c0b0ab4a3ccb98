"""--kv-cache-memory-bytes (vLLM's newer flag): the KV cache's size in bytes, instead of the fraction-based
sizing (--gpu-memory-utilization on CUDA, --cpu-kvcache-space on CPU); --num-gpu-blocks-override still wins."""

from __future__ import annotations

from aserve.config import EngineArgs
from aserve.runner.model_runner import ModelRunner


def _blocks(model: str, **kwargs) -> tuple[int, int]:
    args = EngineArgs(model=model, dtype="float32", skip_tokenizer_init=True, max_model_len=64,
                      cpu_kvcache_space=0.01, max_num_seqs=4, **kwargs)
    runner = ModelRunner(args.create_config(model_path=model))
    runner.load_model()
    info = runner.initialize_kv_cache()
    layer = runner.kv_caches[0]
    assert layer.shape[1] == info.num_blocks
    return info.num_blocks, info.kv_bytes_per_block


def test_kv_cache_memory_bytes_sets_the_block_count(tiny_llama):
    by_fraction, per_block = _blocks(tiny_llama)
    assert by_fraction == int(0.01 * (1 << 30) // per_block)  # --cpu-kvcache-space 0.01 GiB
    for n in (10, 37):
        num_blocks, _ = _blocks(tiny_llama, kv_cache_memory_bytes=n * per_block + per_block // 2)
        assert num_blocks == n  # bytes // bytes-per-block, whatever --cpu-kvcache-space says
    overridden, _ = _blocks(tiny_llama, kv_cache_memory_bytes=10 * per_block, num_gpu_blocks_override=7)
    assert overridden == 7
