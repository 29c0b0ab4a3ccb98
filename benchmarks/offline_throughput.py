"""Offline throughput: aserve's LLM.generate vs Hugging Face transformers' static batches, same run.

    python benchmarks/offline_throughput.py --num-prompts 64 --input-len 200 --output-len 128

Both sides get the same seeded prompts (exactly --input-len tokens each) and generate exactly
--output-len tokens (EOS ignored). Prints output tokens/s for both, the ratio, and how much of the KV
memory in use held real tokens (sampled every step). The prompts and the KV logger come from
`aserve.bench` (`aserve bench throughput` is the vLLM-compatible command without the HF side).
"""

from __future__ import annotations

import argparse
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # aserve from a checkout
from aserve.bench.datasets import make_prompt_token_ids as make_prompts  # also lora_throughput.py's
from aserve.bench.offline import KVUtilization


def run_aserve(args, prompts) -> tuple[float, KVUtilization, str]:
    from aserve import LLM, SamplingParams

    llm = LLM(args.model, dtype=args.dtype, max_num_seqs=args.max_num_seqs,
              max_num_batched_tokens=args.max_num_batched_tokens, block_size=args.block_size,
              enable_prefix_caching=False)
    kv = KVUtilization(args.block_size)
    llm.engine.stat_loggers.append(kv)
    params = SamplingParams(temperature=0.0, max_tokens=args.output_len, ignore_eos=True)
    # Warm up (allocator, kernels) on a couple of prompts.
    llm.generate([{"prompt_token_ids": p} for p in prompts[:2]], SamplingParams(max_tokens=4), use_tqdm=False)
    kv.tokens = kv.capacity = 0
    start = time.perf_counter()
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=not args.quiet)
    elapsed = time.perf_counter() - start
    num = sum(len(o.outputs[0].token_ids) for o in outs)
    assert num == len(prompts) * args.output_len
    return num / elapsed, kv, llm.engine.config.model.dtype


def run_hf(args, model_path, prompts) -> float:
    import torch
    from transformers import AutoModelForCausalLM

    dtype = {"bfloat16": torch.bfloat16, "float32": torch.float32}[args.resolved_dtype]
    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=dtype)
    model.eval()
    pad = 0
    total, start = 0, None
    with torch.inference_mode():
        for warm in (True, False):
            batches = [prompts[:2]] if warm else [prompts[i:i + args.hf_batch_size]
                                                  for i in range(0, len(prompts), args.hf_batch_size)]
            if not warm:
                start = time.perf_counter()
            for batch in batches:
                width = max(len(p) for p in batch)
                ids = torch.tensor([[pad] * (width - len(p)) + p for p in batch])
                mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in batch])
                new = 4 if warm else args.output_len
                out = model.generate(ids, attention_mask=mask, do_sample=False, max_new_tokens=new,
                                     min_new_tokens=new, pad_token_id=pad)
                if not warm:
                    total += (out.shape[1] - width) * len(batch)
    return total / (time.perf_counter() - start)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="", help="default: the bundled SmolLM2-135M-Instruct")
    p.add_argument("--num-prompts", type=int, default=64)
    p.add_argument("--input-len", type=int, default=200)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--dtype", default="auto", help="auto: bf16 on CPUs with native bf16, else fp32 (both sides)")
    p.add_argument("--max-num-seqs", type=int, default=256)
    p.add_argument("--max-num-batched-tokens", type=int, default=2048)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--hf-batch-size", type=int, default=16)
    p.add_argument("--skip-hf", action="store_true")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--quiet", action="store_true")
    args = p.parse_args()

    from transformers import AutoTokenizer

    from aserve.model_source import resolve_model

    model_path = resolve_model(args.model, None, None, "auto")
    tokenizer = AutoTokenizer.from_pretrained(model_path)
    prompts = make_prompts(tokenizer, args.num_prompts, args.input_len, args.seed)

    ours, kv, args.resolved_dtype = run_aserve(args, prompts)
    print(f"aserve LLM.generate      : {ours:8.1f} output tok/s  ({args.num_prompts} prompts x "
          f"{args.input_len} in / {args.output_len} out, {args.resolved_dtype})")
    print(f"KV memory holding tokens : {100 * kv.ratio:.1f}% of the blocks in use (peak {kv.peak_blocks} blocks)")
    if not args.skip_hf:
        hf = run_hf(args, model_path, prompts)
        print(f"HF transformers generate : {hf:8.1f} output tok/s  (static batches of {args.hf_batch_size})")
        print(f"ratio                    : {ours / hf:.2f}x")


if __name__ == "__main__":
    main()
