"""`aserve bench throughput` and `aserve bench latency`: vLLM's offline benchmarks over `aserve.LLM`.

Both take every engine flag `aserve` takes (generated from EngineArgs, vLLM spellings), so a run measures
the engine exactly as it would serve. `throughput` generates `--num-prompts` requests (exactly
`--input-len` prompt token ids, or a ShareGPT file) with EOS ignored and reports vLLM's fields:
elapsed_time, num_requests, total_num_tokens, requests_per_second, tokens_per_second (plus
total_output_tokens, output_tokens_per_second). `latency` times `LLM.generate` on one batch of
`--batch-size` random prompts, `--num-iters-warmup` untimed then `--num-iters` timed: avg_latency,
latencies and percentiles (10, 25, 50, 75, 90, 99) in seconds. `--output-json` writes the dict.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import time

import numpy as np
from tqdm import tqdm

from aserve.bench.datasets import make_prompt_token_ids, sharegpt_requests

LATENCY_PERCENTILES = (10, 25, 50, 75, 90, 99)


class KVUtilization:
    """A stat logger: real tokens held / token capacity of the blocks in use, summed over steps."""

    def __init__(self, block_size: int):
        self.block_size = block_size
        self.tokens = 0
        self.capacity = 0
        self.peak_blocks = 0

    def record(self, sched, iteration) -> None:
        if sched.num_used_blocks:
            self.tokens += sched.num_tokens_in_used_blocks
            self.capacity += sched.num_used_blocks * self.block_size
            self.peak_blocks = max(self.peak_blocks, sched.num_used_blocks)

    @property
    def ratio(self) -> float:
        return self.tokens / self.capacity if self.capacity else 0.0


def add_throughput_arguments(p: argparse.ArgumentParser) -> None:
    from aserve.server.args import add_engine_arguments

    p.add_argument("--input-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--num-prompts", type=int, default=1000)
    p.add_argument("--n", type=int, default=1, help="samples per prompt")
    p.add_argument("--dataset-name", choices=("random", "sharegpt"), default="random")
    p.add_argument("--dataset-path", default=None, help="a ShareGPT JSON file (--dataset-name sharegpt)")
    p.add_argument("--output-json", default=None)
    p.add_argument("--disable-tqdm", action="store_true")
    add_engine_arguments(p)


def add_latency_arguments(p: argparse.ArgumentParser) -> None:
    from aserve.server.args import add_engine_arguments

    p.add_argument("--input-len", type=int, default=32)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--n", type=int, default=1, help="samples per prompt")
    p.add_argument("--num-iters-warmup", type=int, default=10)
    p.add_argument("--num-iters", type=int, default=30)
    p.add_argument("--output-json", default=None)
    p.add_argument("--disable-tqdm", action="store_true")
    add_engine_arguments(p)


def make_llm(args: argparse.Namespace):
    """An aserve.LLM from the namespace's engine flags."""
    from aserve import LLM
    from aserve.config import EngineArgs

    engine_kwargs = {f.name: getattr(args, f.name) for f in dataclasses.fields(EngineArgs)
                     if f.name != "model" and hasattr(args, f.name)}
    return LLM(args.model, **engine_kwargs)


def _random_token_ids(llm, rows: int, length: int, seed: int) -> list[list[int]]:
    """Seeded random prompt ids below min(10000, the vocabulary) (config.json's without a tokenizer)."""
    tokenizer = llm.get_tokenizer()
    if tokenizer is not None:
        vocab = len(tokenizer)
    else:  # --skip-tokenizer-init
        model = llm.engine.config.model
        with open(os.path.join(model.hf_config_path or model.model_path, "config.json"), encoding="utf-8") as f:
            vocab = int(json.load(f)["vocab_size"])
    rng = np.random.default_rng(seed)
    return [[int(t) for t in row] for row in rng.integers(0, min(10000, vocab), size=(rows, length))]


def _write(args: argparse.Namespace, result: dict) -> None:
    if args.output_json:
        with open(args.output_json, "w", encoding="utf-8") as f:
            json.dump(result, f, indent=2)


def run_throughput(args: argparse.Namespace) -> dict:
    from aserve import SamplingParams

    llm = make_llm(args)
    tokenizer = llm.get_tokenizer()
    seed = args.seed or 0
    if args.dataset_name == "sharegpt":
        if not args.dataset_path:
            raise ValueError("--dataset-name sharegpt needs --dataset-path (a ShareGPT JSON file)")
        reqs = sharegpt_requests(args.dataset_path, tokenizer, args.num_prompts, args.output_len, seed)
        prompts = [{"prompt": r.prompt} for r in reqs]
        lens = [(r.prompt_len, r.expected_output_len) for r in reqs]
    else:  # word prompts cut to --input-len tokens; random ids without a tokenizer
        ids = (make_prompt_token_ids(tokenizer, args.num_prompts, args.input_len, seed) if tokenizer is not None
               else _random_token_ids(llm, args.num_prompts, args.input_len, seed))
        prompts = [{"prompt_token_ids": p} for p in ids]
        lens = [(len(p), args.output_len) for p in ids]
    params = [SamplingParams(n=args.n, temperature=1.0 if args.n > 1 else 0.0, max_tokens=out, ignore_eos=True)
              for _, out in lens]
    start = time.perf_counter()
    outputs = llm.generate(prompts, params, use_tqdm=not args.disable_tqdm)
    elapsed = time.perf_counter() - start
    num_output = sum(len(c.token_ids) for o in outputs for c in o.outputs)
    total = sum(p for p, _ in lens) + num_output
    result = {"elapsed_time": elapsed, "num_requests": len(prompts), "total_num_tokens": total,
              "requests_per_second": len(prompts) / elapsed, "tokens_per_second": total / elapsed,
              "total_output_tokens": num_output, "output_tokens_per_second": num_output / elapsed}
    print(f"Throughput: {result['requests_per_second']:.2f} requests/s, {result['tokens_per_second']:.2f} "
          f"total tokens/s, {result['output_tokens_per_second']:.2f} output tokens/s")
    _write(args, result)
    return result


def run_latency(args: argparse.Namespace) -> dict:
    from aserve import SamplingParams

    llm = make_llm(args)
    batch = [{"prompt_token_ids": ids}
             for ids in _random_token_ids(llm, args.batch_size, args.input_len, args.seed or 0)]
    params = SamplingParams(n=args.n, temperature=1.0, top_p=1.0, ignore_eos=True, max_tokens=args.output_len)

    def once() -> float:
        start = time.perf_counter()
        llm.generate(batch, params, use_tqdm=False)
        return time.perf_counter() - start

    for _ in tqdm(range(args.num_iters_warmup), desc="Warmup iterations", disable=args.disable_tqdm):
        once()
    latencies = [once() for _ in tqdm(range(args.num_iters), desc="Profiling iterations",
                                      disable=args.disable_tqdm)]
    result = {"avg_latency": float(np.mean(latencies)), "latencies": latencies,
              "percentiles": {str(p): float(np.percentile(latencies, p)) for p in LATENCY_PERCENTILES}}
    print(f"Avg latency: {result['avg_latency']} seconds")
    for p, value in result["percentiles"].items():
        print(f"{p}% percentile latency: {value} seconds")
    _write(args, result)
    return result
