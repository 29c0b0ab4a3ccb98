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


def save_tiny_hf(path: str | Path, family: str = "llama", seed: int = 0, perturb: bool = True,
                 **overrides: Any) -> Any:
    """Saves a tiny `family` ("llama" | "qwen2" | "mistral" | "qwen3") model to `path` and returns the HF model
    (eval, fp32). `overrides` update `COMMON`. With `perturb`, biases (zero-initialised by HF) and
    norm weights get random values so that they matter in logit comparisons."""
    import torch
    import transformers

    config_cls, model_cls = {
        "llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM),
        "qwen2": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM),
        "mistral": (transformers.MistralConfig, transformers.MistralForCausalLM),
        "qwen3": (transformers.Qwen3Config, transformers.Qwen3ForCausalLM),
    }[family]
    config = config_cls(**{**COMMON, **overrides})
    config._attn_implementation = "eager"
    torch.manual_seed(seed)
    model = model_cls(config).eval()
    if perturb:
        with torch.no_grad():
            for name, p in model.named_parameters():
                if name.endswith("bias"):
                    p.normal_(0, 0.2)
                if "norm" in name:
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
