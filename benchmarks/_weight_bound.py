"""The weight-stream bound of a decode step on this machine: the bytes of weights a bf16 decode token
reads (every decoder layer's projections and the LM head), over the memory's read bandwidth measured
here (a sum over 1 GiB, far beyond the caches, on every core). A c=1 ITL cannot beat it by much: the
weights do not fit in any cache."""

from __future__ import annotations

import json
import os
import time


def dram_read_gbps(mib: int = 1024, repeats: int = 5) -> float:
    """Best of `repeats` reads of a `mib` MiB float32 tensor (torch.sum, every thread), in GB/s."""
    import torch

    data = torch.ones(mib * 2**20 // 4, dtype=torch.float32)
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        data.sum()
        best = min(best, time.perf_counter() - start)
    return data.numel() * 4 / best / 1e9


def bf16_decode_bytes(hf_folder: str) -> int:
    """Bytes of bf16 weights one decode token streams for the Llama-shaped model in `hf_folder`."""
    with open(os.path.join(hf_folder, "config.json")) as f:
        cfg = json.load(f)
    h, inter, layers = cfg["hidden_size"], cfg["intermediate_size"], cfg["num_hidden_layers"]
    heads = cfg["num_attention_heads"]
    kv_heads = cfg.get("num_key_value_heads", heads)
    head_dim = cfg.get("head_dim") or h // heads
    per_layer = h * (heads + 2 * kv_heads) * head_dim + heads * head_dim * h + 3 * h * inter
    return 2 * (layers * per_layer + cfg["vocab_size"] * h)


def weight_bound_line(hf_folder: str | None) -> str:
    """'X ms per bf16 token (Y MB of weights at Z GB/s measured)', or why there is none."""
    try:
        nbytes = bf16_decode_bytes(hf_folder) if hf_folder else None
    except (OSError, KeyError, ValueError) as exc:
        return f"unknown (the model's config.json: {exc})"
    if nbytes is None:
        return "unknown (no Hugging Face folder for the model)"
    gbps = dram_read_gbps()
    return f"{nbytes / gbps / 1e6:.1f} ms per bf16 token ({nbytes / 1e6:.0f} MB of weights at {gbps:.1f} GB/s measured)"
