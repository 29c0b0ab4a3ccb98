"""Decode step time per model family at one parameter budget (by hand, not CI).

Each family gets a config.json of the same 135M-class shape as SmolLM2-135M (hidden 576, 30 layers,
9 heads / 3 KV heads, MLP 1536, vocab 49152; each family's own extras on top), random weights
(`--load-format dummy`), and runs `LLM.generate` on B prompts of 32 tokens with 64 greedy tokens
each. The median time of the steps that only decoded (B rows) is printed per family and batch, so a
family that falls off the fast CPU path shows at once.

    python benchmarks/family_steps.py --batch-sizes 1,16 [--families llama,qwen3,gemma2] [--dtype bfloat16]
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

from _decode_steps import decode_step_ms

SHAPE = {"vocab_size": 49152, "hidden_size": 576, "intermediate_size": 1536, "num_hidden_layers": 30,
         "num_attention_heads": 9, "num_key_value_heads": 3, "max_position_embeddings": 2048,
         "rms_norm_eps": 1e-5, "tie_word_embeddings": True, "bos_token_id": 1, "eos_token_id": 2}

FAMILIES = {
    "llama": {"architectures": ["LlamaForCausalLM"]},
    "qwen2": {"architectures": ["Qwen2ForCausalLM"]},
    "qwen3": {"architectures": ["Qwen3ForCausalLM"], "head_dim": 64},
    "mistral": {"architectures": ["MistralForCausalLM"], "sliding_window": 1024},
    "gemma2": {"architectures": ["Gemma2ForCausalLM"], "head_dim": 64, "query_pre_attn_scalar": 64,
               "sliding_window": 1024, "hidden_activation": "gelu_pytorch_tanh",
               "attn_logit_softcapping": 50.0, "final_logit_softcapping": 30.0},
    "gemma3": {"architectures": ["Gemma3ForCausalLM"], "head_dim": 64, "query_pre_attn_scalar": 64,
               "sliding_window": 1024, "hidden_activation": "gelu_pytorch_tanh", "rope_local_base_freq": 10000.0},
    "phi3": {"architectures": ["Phi3ForCausalLM"], "partial_rotary_factor": 0.75},
    # No GQA in these two: their KV heads are all 9 heads (a little more attention work per step).
    "gpt2": {"architectures": ["GPT2LMHeadModel"], "n_inner": 1536, "activation_function": "gelu_new"},
    "opt": {"architectures": ["OPTForCausalLM"], "ffn_dim": 1536, "word_embed_proj_dim": 576,
            "do_layer_norm_before": True, "activation_function": "relu"},
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--families", default=",".join(FAMILIES))
    parser.add_argument("--batch-sizes", default="1,16")
    parser.add_argument("--dtype", default="bfloat16")
    args = parser.parse_args()
    batches = [int(b) for b in args.batch_sizes.split(",")]
    print("| family | " + " | ".join(f"decode step at batch {b} (ms)" for b in batches) + " |")
    print("|---|" + "---:|" * len(batches))
    for family in args.families.split(","):
        row = []
        for batch in batches:
            with tempfile.TemporaryDirectory() as tmp:
                row.append(f"{decode_step_ms({**SHAPE, **FAMILIES[family]}, batch, args.dtype, Path(tmp)):.1f}")
        print(f"| {family} | " + " | ".join(row) + " |", flush=True)


if __name__ == "__main__":
    main()
