"""Decode step time of a mixture-of-experts model vs a dense model with the same active parameters
(by hand, not CI).

Both models share a SmolLM2-135M-class attention (hidden 576, 9 heads / 3 KV heads, vocab 49152) and
`--layers` layers with random weights (`--load-format dummy`). The dense model's MLP is
`--experts-per-token * --expert-size` wide; the MoE model has `--experts` experts of `--expert-size`
each and routes every token to `--experts-per-token` of them, so both multiply each token by the
same number of weights (the MoE model holds `experts / experts_per_token` times more MLP weights).
`LLM.generate` runs B prompts of 32 tokens with 64 greedy tokens each; the median time of the steps
that only decoded is printed per model and batch size.

    python benchmarks/moe_step.py --batch-sizes 1,16 [--moe-family mixtral|qwen3_moe] [--dtype bfloat16]
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

from _decode_steps import decode_step_ms

ATTENTION = {"vocab_size": 49152, "hidden_size": 576, "num_attention_heads": 9, "num_key_value_heads": 3,
             "max_position_embeddings": 2048, "rms_norm_eps": 1e-5, "tie_word_embeddings": True,
             "bos_token_id": 1, "eos_token_id": 2, "head_dim": 64}


def configs(args: argparse.Namespace) -> dict[str, dict]:
    dense_width = args.experts_per_token * args.expert_size
    moe = {"num_experts_per_tok": args.experts_per_token}
    if args.moe_family == "mixtral":
        dense = {"architectures": ["LlamaForCausalLM"], "intermediate_size": dense_width}
        moe |= {"architectures": ["MixtralForCausalLM"], "num_local_experts": args.experts,
                "intermediate_size": args.expert_size}
    else:
        dense = {"architectures": ["Qwen3ForCausalLM"], "intermediate_size": dense_width}
        moe |= {"architectures": ["Qwen3MoeForCausalLM"], "num_experts": args.experts,
                "moe_intermediate_size": args.expert_size, "intermediate_size": dense_width, "norm_topk_prob": True}
    base = {**ATTENTION, "num_hidden_layers": args.layers}
    return {f"dense ({dense['architectures'][0]}, MLP {dense_width})": {**base, **dense},
            f"MoE ({moe['architectures'][0]}, {args.experts} x {args.expert_size}, top {args.experts_per_token})":
                {**base, **moe}}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batch-sizes", default="1,16")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--moe-family", choices=["mixtral", "qwen3_moe"], default="mixtral")
    parser.add_argument("--layers", type=int, default=12)
    parser.add_argument("--experts", type=int, default=8)
    parser.add_argument("--experts-per-token", type=int, default=2)
    parser.add_argument("--expert-size", type=int, default=768)
    args = parser.parse_args()
    batches = [int(b) for b in args.batch_sizes.split(",")]
    print(f"{args.layers} layers, {args.dtype}")
    print("| model | " + " | ".join(f"decode step at batch {b} (ms)" for b in batches) + " |")
    print("|---|" + "---:|" * len(batches))
    for name, config in configs(args).items():
        row = []
        for batch in batches:
            with tempfile.TemporaryDirectory() as tmp:
                row.append(f"{decode_step_ms(config, batch, args.dtype, Path(tmp)):.1f}")
        print(f"| {name} | " + " | ".join(row) + " |", flush=True)


if __name__ == "__main__":
    main()
