"""Tensor parallelism on one CPU: decode step time at TP=2 against TP=1, and what the collectives cost
inside the step (by hand, not CI).

A 1B-class Llama shape (Llama-3.2-1B: hidden 2048, 16 layers, 32 heads / 8 KV heads, MLP 8192, vocab
128256, tied) with random weights (`--load-format dummy`):

1. `LLM.generate` on B prompts of 32 tokens, 64 greedy tokens each, over the `mp` executor: TP=1 (one
   worker with every core), TP=2 (two workers, half the cores each) with the shared-memory collectives
   (the CPU default) and with gloo only (`ASERVE_CPU_SHM_COLLECTIVES=0`). The median time of the steps
   that only decoded, per batch size, as the engine sees them.
2. The collectives inside a step: two ranks run the runner's decode step directly (the same layers and
   thread split) with every all-reduce / all-gather the layers call timed: per step, 2 all-reduces of
   `[B, hidden]` per layer, one for the embedding, one all-gather of the logits.

    python benchmarks/tp_step.py [--batch-sizes 1,16] [--dtype bfloat16]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time
from pathlib import Path

from _decode_steps import DecodeSteps

SHAPE = {"architectures": ["LlamaForCausalLM"], "vocab_size": 128256, "hidden_size": 2048,
         "intermediate_size": 8192, "num_hidden_layers": 16, "num_attention_heads": 32, "num_key_value_heads": 8,
         "head_dim": 64, "max_position_embeddings": 8192, "rms_norm_eps": 1e-5, "rope_theta": 500000.0,
         "tie_word_embeddings": True, "bos_token_id": 1, "eos_token_id": 2}
PROMPT_LEN, NUM_STEPS = 32, 64


def engine_steps(folder: Path, tp: int, batches: list[int], dtype: str) -> dict[int, float]:
    """Median decode step (ms) per batch size through `LLM.generate` at `tp` ranks."""
    from aserve import LLM, SamplingParams

    llm = LLM(str(folder), load_format="dummy", skip_tokenizer_init=True, dtype=dtype, max_model_len=256,
              enable_prefix_caching=False, tensor_parallel_size=tp, distributed_executor_backend="mp",
              cpu_kvcache_space=1)
    steps = DecodeSteps()
    llm.engine.stat_loggers.append(steps)
    result = {}
    try:
        llm.generate([{"prompt_token_ids": list(range(3, 35))}], SamplingParams(max_tokens=4, detokenize=False),
                     use_tqdm=False)  # warm-up
        for batch in batches:
            prompts = [{"prompt_token_ids": [3 + (7 * i + j) % 1000 for j in range(PROMPT_LEN)]} for i in range(batch)]
            steps.times.clear()
            llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=NUM_STEPS, ignore_eos=True,
                                                 detokenize=False), use_tqdm=False)
            result[batch] = statistics.median(steps.times) * 1000
    finally:
        llm.engine.shutdown()
    return result


def _timed(fn, spent: list[float]):
    def wrapper(*args):
        start = time.perf_counter()
        out = fn(*args)
        spent.append(time.perf_counter() - start)
        return out

    return wrapper


def _rank_steps(rank: int, port: int, folder: str, dtype: str, batches: list[int], out: str) -> None:
    """One rank: the runner's decode steps with the layers' collectives timed (the benchmark wraps the
    functions the layer modules call; nothing in aserve is instrumented)."""
    import torch

    from aserve.config import EngineArgs
    from aserve.core.batch import CachedRequestData, NewRequestData, SchedulerOutput
    from aserve.distributed.context import init_distributed, shutdown_distributed
    from aserve.distributed.rendezvous import Rendezvous
    from aserve.model.layers import embedding, linear
    from aserve.runner.model_runner import ModelRunner
    from aserve.sampling_params import SamplingParams

    torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))
    spent: list[float] = []
    linear.all_reduce = _timed(linear.all_reduce, spent)
    embedding.all_reduce = _timed(embedding.all_reduce, spent)
    embedding.all_gather_last_dim = _timed(embedding.all_gather_last_dim, spent)
    config = EngineArgs(model=folder, load_format="dummy", skip_tokenizer_init=True, dtype=dtype, max_model_len=256,
                        cpu_kvcache_space=1, tensor_parallel_size=2).create_config()
    runner = ModelRunner(config, parallel=init_distributed(Rendezvous("127.0.0.1", port, 2, "gloo", 120), rank))
    runner.load_model()
    runner.initialize_kv_cache()
    params = SamplingParams(temperature=0, max_tokens=1000, ignore_eos=True)
    blocks_per_seq = (PROMPT_LEN + NUM_STEPS) // config.cache.block_size + 1
    result, next_block = {}, 1
    for batch in batches:
        ids = [f"b{batch}-{i}" for i in range(batch)]
        new = []
        for i, req_id in enumerate(ids):
            prompt = [3 + (7 * i + j) % 1000 for j in range(PROMPT_LEN)]
            new.append(NewRequestData(req_id, prompt, [], params, list(range(next_block, next_block + blocks_per_seq)),
                                      0, []))
            next_block += blocks_per_seq
        runner.execute(SchedulerOutput(new, [], ids, [PROMPT_LEN] * batch, []))
        steps, comm = [], []
        for step in range(NUM_STEPS):
            spent.clear()
            start = time.perf_counter()
            runner.execute(SchedulerOutput([], [CachedRequestData(r, [], PROMPT_LEN + step) for r in ids], ids,
                                           [1] * batch, []))
            steps.append(time.perf_counter() - start)
            comm.append((sum(spent), len(spent)))
        runner.execute(SchedulerOutput([], [], [], [], ids))  # finished: drop them
        result[batch] = {"step_ms": statistics.median(steps[4:]) * 1000,
                         "comm_ms": statistics.median(c[0] for c in comm[4:]) * 1000,
                         "calls": comm[-1][1]}
    if rank == 0:
        Path(out).write_text(json.dumps(result))
    shutdown_distributed()


def rank_steps(folder: Path, dtype: str, batches: list[int], shm: bool) -> dict:
    import torch.multiprocessing

    from aserve.distributed.rendezvous import free_port

    os.environ["ASERVE_CPU_SHM_COLLECTIVES"] = "1" if shm else "0"
    threads = os.environ.get("OMP_NUM_THREADS")
    os.environ["OMP_NUM_THREADS"] = str(max(1, len(os.sched_getaffinity(0)) // 2))  # before the ranks import torch
    try:
        with tempfile.TemporaryDirectory() as tmp:
            out = str(Path(tmp) / "steps.json")
            torch.multiprocessing.spawn(_rank_steps, args=(free_port(), str(folder), dtype, batches, out), nprocs=2)
            return {int(k): v for k, v in json.loads(Path(out).read_text()).items()}
    finally:
        if threads is None:
            os.environ.pop("OMP_NUM_THREADS")
        else:
            os.environ["OMP_NUM_THREADS"] = threads


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batch-sizes", default="1,16")
    parser.add_argument("--dtype", default="bfloat16")
    args = parser.parse_args()
    batches = [int(b) for b in args.batch_sizes.split(",")]
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        (folder / "config.json").write_text(json.dumps(SHAPE))
        engine = {"TP=1": engine_steps(folder, 1, batches, args.dtype)}
        for name, shm in (("TP=2 shm", True), ("TP=2 gloo", False)):
            os.environ["ASERVE_CPU_SHM_COLLECTIVES"] = "1" if shm else "0"
            engine[name] = engine_steps(folder, 2, batches, args.dtype)
        ranks = {name: rank_steps(folder, args.dtype, batches, shm) for name, shm in (("shm", True), ("gloo", False))}
    os.environ.pop("ASERVE_CPU_SHM_COLLECTIVES", None)
    print(f"1B-class Llama shape (Llama-3.2-1B), {args.dtype}, dummy weights; decode step median (ms)")
    print("| batch | TP=1 | TP=2, shared-memory collectives | TP=2, gloo only "
          "| TP=2 collectives per step, shm (ms, calls) | TP=2 collectives per step, gloo (ms) |")
    print("|---:|---:|---:|---:|---:|---:|")
    for b in batches:
        print(f"| {b} | {engine['TP=1'][b]:.1f} | {engine['TP=2 shm'][b]:.1f} | {engine['TP=2 gloo'][b]:.1f} "
              f"| {ranks['shm'][b]['comm_ms']:.1f} of {ranks['shm'][b]['step_ms']:.1f} ({ranks['shm'][b]['calls']}) "
              f"| {ranks['gloo'][b]['comm_ms']:.1f} of {ranks['gloo'][b]['step_ms']:.1f} |", flush=True)


if __name__ == "__main__":
    main()
