"""Tiny random-weight Hugging Face models (fp32 safetensors) built on the fly, and Hugging Face's own
greedy decoding as the reference our engine must match."""

from __future__ import annotations

from pathlib import Path
from typing import Any

VOCAB = 500
COMMON = {"vocab_size": VOCAB, "hidden_size": 64, "intermediate_size": 96, "num_hidden_layers": 2,
          "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 256,
          "initializer_range": 0.08, "rms_norm_eps": 1e-6}

# For token-for-token greedy comparisons: a larger init separates the logits, so greedy decoding is
# stable under float rounding differences between implementations.
GREEDY_STABLE = {"vocab_size": 512, "intermediate_size": 128, "max_position_embeddings": 1024,
                 "rms_norm_eps": 1e-5, "initializer_range": 0.15, "bos_token_id": 1, "eos_token_id": 2}

# Families whose config class spells the keys above differently: {common key: its own key, or None
# where it has none (the key is dropped)}.
_KEY_RENAMES = {
    "gpt2": {"intermediate_size": "n_inner", "rms_norm_eps": "layer_norm_epsilon", "num_key_value_heads": None},
    "opt": {"intermediate_size": "ffn_dim", "initializer_range": "init_std", "rms_norm_eps": None,
            "num_key_value_heads": None},
}


# Tiny sizes for keys only some families have (MoE: the class defaults hold 60-128 experts).
_FAMILY_DEFAULTS: dict[str, dict[str, Any]] = {
    "mixtral": {"num_local_experts": 4, "num_experts_per_tok": 2},
    "qwen2_moe": {"num_experts": 8, "num_experts_per_tok": 2, "moe_intermediate_size": 48,
                  "shared_expert_intermediate_size": 80},
    "qwen3_moe": {"num_experts": 8, "num_experts_per_tok": 2, "moe_intermediate_size": 48, "norm_topk_prob": True},
}


def save_tiny_hf(path: str | Path, family: str = "llama", seed: int = 0, perturb: bool = True,
                 **overrides: Any) -> Any:
    """Saves a tiny `family` ("llama" | "qwen2" | "mistral" | "qwen3" | ... | "mixtral" | "qwen2_moe" |
    "qwen3_moe") model to `path` and returns the HF model
    (eval, fp32). `overrides` update `COMMON`. With `perturb`, biases (zero-initialised by HF) and
    norm weights get random values so that they matter in logit comparisons."""
    import torch
    import transformers

    config_cls, model_cls = {
        "llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM),
        "qwen2": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM),
        "mistral": (transformers.MistralConfig, transformers.MistralForCausalLM),
        "qwen3": (transformers.Qwen3Config, transformers.Qwen3ForCausalLM),
        # Phi3Config's default pad/eos ids (32000) lie outside the tiny vocabulary.
        "phi3": (lambda **kw: transformers.Phi3Config(**{"pad_token_id": None, "eos_token_id": None, **kw}),
                 transformers.Phi3ForCausalLM),
        "gemma2": (transformers.Gemma2Config, transformers.Gemma2ForCausalLM),
        "gemma3": (transformers.Gemma3TextConfig, transformers.Gemma3ForCausalLM),
        # GPT2Config's default bos/eos id (50256) lies outside the tiny vocabulary.
        "gpt2": (lambda **kw: transformers.GPT2Config(**{"bos_token_id": None, "eos_token_id": None, **kw}),
                 transformers.GPT2LMHeadModel),
        "opt": (transformers.OPTConfig, transformers.OPTForCausalLM),
        "mixtral": (transformers.MixtralConfig, transformers.MixtralForCausalLM),
        "qwen2_moe": (transformers.Qwen2MoeConfig, transformers.Qwen2MoeForCausalLM),
        "qwen3_moe": (transformers.Qwen3MoeConfig, transformers.Qwen3MoeForCausalLM),
    }[family]
    keys = {**COMMON, **_FAMILY_DEFAULTS.get(family, {}), **overrides}
    renames = _KEY_RENAMES.get(family, {})
    keys = {renames.get(k, k): v for k, v in keys.items() if renames.get(k, k) is not None}
    config = config_cls(**keys)
    config._attn_implementation = "eager"
    torch.manual_seed(seed)
    model = model_cls(config).eval()
    if perturb:
        with torch.no_grad():
            for name, p in model.named_parameters():
                if name.endswith("bias"):
                    p.normal_(0, 0.2)
                elif "norm" in name or ".ln_" in name:  # GPT-2 names its LayerNorms ln_1, ln_2, ln_f
                    p.uniform_(0.5, 1.5)
    model.save_pretrained(str(path), safe_serialization=True)
    return model


def hf_greedy(model_dir: str, prompts: list[list[int]], max_new_tokens: int, ignore_eos: bool) -> list[list[int]]:
    """Hugging Face transformers' greedy generate in fp32, one prompt at a time (no padding effects)."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    model.eval()
    outs = []
    with torch.inference_mode():
        for p in prompts:
            ids = torch.tensor([p])
            kwargs = {"do_sample": False, "max_new_tokens": max_new_tokens, "attention_mask": torch.ones_like(ids)}
            if ignore_eos:
                kwargs.update(eos_token_id=None, pad_token_id=0)
            out = model.generate(ids, **kwargs)
            outs.append(out[0, len(p):].tolist())
    return outs
