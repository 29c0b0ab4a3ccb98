"""Multi-LoRA throughput: 16 requests spread over 4 adapters against the same 16 requests on the base
model, in one run on the bundled SmolLM2-135M-Instruct (its own 4-bit GGUF weights), plus adapter
load time.

    python benchmarks/lora_throughput.py --num-prompts 16 --input-len 128 --output-len 128 --rank 16

The adapters are PEFT LoRA adapters of rank --rank on all seven projections (q, k, v, o, gate, up,
down) with random non-zero weights, saved by PEFT for SmolLM2's shape (no download). Every request is
in flight at once (c = --num-prompts). Each side runs --repeats times, alternating, after a warm-up;
the best of each is reported, as the ratio adapters / base of output tokens per second.
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time

from benchmarks.offline_throughput import make_prompts

TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def save_adapters(model_dir: str, out_dir: str, num: int, rank: int) -> list[str]:
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(model_dir)
    paths = []
    for i in range(num):
        torch.manual_seed(100 + i)
        base = AutoModelForCausalLM.from_config(config)
        peft_model = get_peft_model(base, LoraConfig(r=rank, lora_alpha=2 * rank, target_modules=TARGETS,
                                                     init_lora_weights=False))
        path = os.path.join(out_dir, f"adapter{i}")
        peft_model.save_pretrained(path)
        paths.append(path)
    return paths


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--num-prompts", type=int, default=16)
    ap.add_argument("--num-adapters", type=int, default=4)
    ap.add_argument("--input-len", type=int, default=128)
    ap.add_argument("--output-len", type=int, default=128)
    ap.add_argument("--rank", type=int, default=16)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--lora-dtype", default="auto")
    args = ap.parse_args()

    from aserve import LLM, LoRARequest, SamplingParams
    from aserve.model_source import resolve_model

    llm = LLM("", enable_lora=True, max_loras=args.num_adapters, max_lora_rank=args.rank, lora_dtype=args.lora_dtype,
              max_num_seqs=args.num_prompts)
    with tempfile.TemporaryDirectory() as tmp:
        paths = save_adapters(resolve_model(""), tmp, args.num_adapters, args.rank)
        loras = [LoRARequest(f"adapter{i}", i + 1, p) for i, p in enumerate(paths)]
        start = time.perf_counter()
        for lora in loras:
            llm.add_lora(lora)
        load_ms = (time.perf_counter() - start) * 1000 / len(loras)
        prompts = make_prompts(llm.get_tokenizer(), args.num_prompts, args.input_len, seed=0)
        params = SamplingParams(temperature=0.0, max_tokens=args.output_len, ignore_eos=True)
        batch = [{"prompt_token_ids": p} for p in prompts]
        mixed = [loras[i % len(loras)] for i in range(len(prompts))]

        def run(lora_request) -> float:
            t = time.perf_counter()
            outs = llm.generate(batch, params, use_tqdm=False, lora_request=lora_request)
            return sum(len(o.outputs[0].token_ids) for o in outs) / (time.perf_counter() - t)

        run(None), run(mixed)  # warm-up: kernels compiled, adapters in their slots
        base, lora = [], []
        for _ in range(args.repeats):
            base.append(run(None))
            lora.append(run(mixed))
    print(f"prompts={args.num_prompts} adapters={args.num_adapters} rank={args.rank} "
          f"in={args.input_len} out={args.output_len}")
    print(f"adapter load (host cache, per adapter): {load_ms:.0f} ms")
    print(f"base model : {max(base):7.1f} output tok/s  (runs: {', '.join(f'{x:.1f}' for x in base)})")
    print(f"{args.num_adapters} adapters : {max(lora):7.1f} output tok/s  (runs: {', '.join(f'{x:.1f}' for x in lora)})")
    print(f"ratio      : {max(lora) / max(base):.2f}")


if __name__ == "__main__":
    main()
