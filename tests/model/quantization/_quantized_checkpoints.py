"""Test helper: GPTQ / AWQ checkpoints written from a tiny random Hugging Face model with each format's
reference quantization (round to nearest, per-group scale and zero point, fp16 scales) and its exact
on-disk packing, plus the dequantized fp32 copy as a normal checkpoint."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from tests.support.tiny_models import GREEDY_STABLE, save_tiny_hf

PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)
# Projections sharing an input (fused by aserve) share GPTQ's act-order permutation, as GPTQ computes it
# from the same Hessian.
_INPUT_OF = {"q_proj": "attn", "k_proj": "attn", "v_proj": "attn", "o_proj": "o",
             "gate_proj": "mlp", "up_proj": "mlp", "down_proj": "down"}


def _to_int32(words: torch.Tensor) -> torch.Tensor:
    words = words & 0xFFFFFFFF
    return torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)


def pack(codes: torch.Tensor, dim: int, order: tuple[int, ...] | None = None, bits: int = 4) -> torch.Tensor:
    """Pack integer `codes` along `dim`, `32 / bits` a word; element `order[i]` of each run of 8 goes to
    nibble i (sequential without `order`)."""
    per = 32 // bits
    c = codes.to(torch.int64).movedim(dim, -1)
    c = c.reshape(*c.shape[:-1], c.shape[-1] // per, per)
    if order is not None:
        c = c[..., list(order)]
    words = (c << (torch.arange(per) * bits)).sum(-1)
    return _to_int32(words).movedim(-1, dim).contiguous()


def quantize_groups(w: torch.Tensor, g_idx: torch.Tensor, num_groups: int, sym: bool, bits: int = 4):
    """GPTQ/AWQ-style round-to-nearest: (codes [N, K], scales fp16 [N, G], zeros int [N, G])."""
    maxq = 2**bits - 1
    n = w.shape[0]
    scales = torch.empty(n, num_groups, dtype=torch.float16)
    zeros = torch.empty(n, num_groups, dtype=torch.int64)
    codes = torch.empty(w.shape, dtype=torch.int64)
    for g in range(num_groups):
        cols = (g_idx == g).nonzero().flatten()
        x = w[:, cols]
        lo, hi = x.amin(1).clamp(max=0), x.amax(1).clamp(min=0)
        if sym:
            hi = torch.maximum(lo.abs(), hi)
            lo = -hi
        s = ((hi - lo) / maxq).clamp(min=1e-5).half()
        z = torch.full((n,), (maxq + 1) // 2, dtype=torch.int64) if sym else (-lo / s.float()).round().long()
        scales[:, g], zeros[:, g] = s, z.clamp(0, maxq)
        codes[:, cols] = ((x / s.float()[:, None]).round().long() + zeros[:, g, None]).clamp(0, maxq)
    return codes, scales, zeros


def dequantize(codes, scales, zeros, g_idx) -> torch.Tensor:
    return (codes.float() - zeros.float()[:, g_idx]) * scales.float()[:, g_idx]


def build(root: Path, fmt: str, *, group_size: int = 32, desc_act: bool = False, sym: bool = True,
          v1: bool = True, family: str = "llama", wrong_order: bool = False, seed: int = 0,
          **overrides) -> tuple[Path, Path]:
    """Write `(quantized folder, dequantized fp32 folder)` under `root` for `fmt` ("gptq" | "awq" | "compressed-tensors").
    `wrong_order` packs AWQ's codes in GPTQ's sequential nibble order (a packing bug on purpose)."""
    src, quant, deq = root / "src", root / "quantized", root / "dequantized"
    sym = {"gptq": sym, "awq": False}.get(fmt, True)  # AWQ GEMM: zero points; compressed-tensors here: symmetric
    save_tiny_hf(src, family, seed=seed, **{**GREEDY_STABLE, "tie_word_embeddings": False, **overrides})
    state = load_file(str(src / "model.safetensors"))
    gen = torch.Generator().manual_seed(seed + 1)
    perms: dict[tuple[str, str], torch.Tensor] = {}
    qstate, dstate = {}, {}
    for name, w in state.items():
        parts = name.split(".")
        if len(parts) < 3 or parts[-2] not in PROJECTIONS or parts[-1] != "weight":
            qstate[name] = dstate[name] = w
            continue
        prefix, proj = name[: -len(".weight")], parts[-2]
        n, k = w.shape
        gs = k if group_size == -1 else group_size
        groups = -(-k // gs)
        if desc_act:
            key = (parts[2], _INPUT_OF[proj])
            if key not in perms:
                perms[key] = torch.randperm(k, generator=gen)
            g_idx = torch.empty(k, dtype=torch.int64)
            g_idx[perms[key]] = torch.arange(k) // gs  # column perm[i] is the i-th quantized
        else:
            g_idx = torch.arange(k) // gs
        codes, scales, zeros = quantize_groups(w.float(), g_idx, groups, sym)
        dstate[name] = dequantize(codes, scales, zeros, g_idx).contiguous()
        if fmt == "gptq":
            stored_zeros = zeros - 1 if v1 else zeros
            qstate[f"{prefix}.qweight"] = pack(codes.t(), 0)
            qstate[f"{prefix}.qzeros"] = pack(stored_zeros.t(), 1)
            qstate[f"{prefix}.scales"] = scales.t().contiguous()
            qstate[f"{prefix}.g_idx"] = g_idx.to(torch.int32)
        elif fmt == "compressed-tensors":  # symmetric: codes stored as q + 8 of signed q = codes - 8
            qstate[f"{prefix}.weight_packed"] = pack(codes, 1)
            qstate[f"{prefix}.weight_scale"] = scales.contiguous()
            qstate[f"{prefix}.weight_shape"] = torch.tensor([n, k], dtype=torch.int32)
        else:
            order = None if wrong_order else AWQ_ORDER
            qstate[f"{prefix}.qweight"] = pack(codes.t(), 1, order)
            qstate[f"{prefix}.qzeros"] = pack(zeros.t(), 1, order)
            qstate[f"{prefix}.scales"] = scales.t().contiguous()
    if fmt == "gptq":
        qc = {"quant_method": "gptq", "bits": 4, "group_size": group_size, "desc_act": desc_act, "sym": sym,
              "checkpoint_format": "gptq" if v1 else "gptq_v2"}
    elif fmt == "compressed-tensors":
        qc = {"quant_method": "compressed-tensors", "format": "pack-quantized", "ignore": ["lm_head"],
              "config_groups": {"group_0": {"targets": ["Linear"], "input_activations": None, "weights": {
                  "num_bits": 4, "type": "int", "symmetric": True, "strategy": "group", "group_size": group_size}}}}
    else:
        qc = {"quant_method": "awq", "bits": 4, "group_size": group_size, "zero_point": True, "version": "gemm"}
    write_pair(src, quant, qstate, deq, dstate, qc)
    return quant, deq


def write_pair(src: Path, quant: Path, qstate: dict, deq: Path, dstate: dict, quantization_config: dict) -> None:
    """Write the quantized folder (`qstate`, config.json with `quantization_config`) and its dequantized
    fp32 copy (`dstate`, config.json as `src`'s), each with `src`'s generation_config.json."""
    config = json.loads((src / "config.json").read_text())
    for folder, tensors, cfg in ((quant, qstate, {**config, "quantization_config": quantization_config}),
                                 (deq, dstate, config)):
        folder.mkdir(parents=True, exist_ok=True)
        save_file(tensors, str(folder / "model.safetensors"), metadata={"format": "pt"})
        for extra in src.glob("generation_config.json"):
            shutil.copy(extra, folder / extra.name)
        (folder / "config.json").write_text(json.dumps(cfg))
