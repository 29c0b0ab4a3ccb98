"""Pipeline parallelism on one CPU: offline generation throughput at PP=2 against one rank and TP=2, and
what keeping two steps in flight buys over one (by hand, not CI).

A 1B-class Llama shape (as `tp_step.py`: hidden 2048, 16 layers, 32 / 8 heads, MLP 8192, vocab 128256,
tied) with random weights (`--load-format dummy`), `LLM.generate` on B prompts of 32 tokens with 64
greedy tokens each, over the `mp` executor; output tokens per second of wall time after a warm-up:

- 1 rank (one worker with every core),
- TP=2 (two workers, half the cores each, shared-memory collectives),
- PP=2 (two stages, half the cores each, two steps in flight: the running requests split into two
  micro-batches),
- PP=2 with one step in flight (the same micro-batches, the stages taking turns: what the overlap is
  worth).

    python benchmarks/pp_throughput.py [--batch-sizes 1,16] [--dtype bfloat16]
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

from tp_step import NUM_STEPS, PROMPT_LEN, SHAPE


def throughput(folder: Path, batch: int, dtype: str, tp: int = 1, pp: int = 1, in_flight: int | None = None) -> float:
    """Output tokens/s of `LLM.generate` for `batch` prompts (`in_flight`: override the steps the engine
    keeps in flight; the scheduler still splits the running requests into `pp` micro-batches)."""
    from aserve import LLM, SamplingParams

    llm = LLM(str(folder), load_format="dummy", skip_tokenizer_init=True, dtype=dtype, max_model_len=256,
              enable_prefix_caching=False, tensor_parallel_size=tp, pipeline_parallel_size=pp,
              distributed_executor_backend="mp", cpu_kvcache_space=1)
    if in_flight is not None:  # the benchmark's knob only: the engine keeps one step per stage in flight
        llm.engine.core.max_steps_in_flight = in_flight
    params = SamplingParams(temperature=0.0, max_tokens=NUM_STEPS, ignore_eos=True, detokenize=False)
    try:
        llm.generate([{"prompt_token_ids": list(range(3, 35))}], params, use_tqdm=False)  # warm-up
        prompts = [{"prompt_token_ids": [3 + (7 * i + j) % 1000 for j in range(PROMPT_LEN)]} for i in range(batch)]
        start = time.perf_counter()
        llm.generate(prompts, params, use_tqdm=False)
        return batch * NUM_STEPS / (time.perf_counter() - start)
    finally:
        llm.engine.shutdown()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batch-sizes", default="1,16")
    parser.add_argument("--dtype", default="bfloat16")
    args = parser.parse_args()
    systems = {"1 rank": {}, "TP=2": {"tp": 2}, "PP=2": {"pp": 2},
               "PP=2, one step in flight": {"pp": 2, "in_flight": 1}}
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        (folder / "config.json").write_text(json.dumps(SHAPE))
        batches = [int(b) for b in args.batch_sizes.split(",")]
        rows = {name: {b: throughput(folder, b, args.dtype, **kw) for b in batches} for name, kw in systems.items()}
    print("| output tok/s | " + " | ".join(f"batch {b}" for b in batches) + " |")
    print("|---|" + "---:|" * len(batches))
    for name, row in rows.items():
        print(f"| {name} | " + " | ".join(f"{row[b]:.1f}" for b in batches) + " |")


if __name__ == "__main__":
    main()
