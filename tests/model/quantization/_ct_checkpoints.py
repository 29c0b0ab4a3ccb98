"""Test helper: compressed-tensors checkpoints as llm-compressor writes them, built from a tiny random Llama
(`save_tiny_hf`): `int-quantized` W8A8 int8 (dynamic per-token or static per-tensor activations),
`float-quantized` FP8, `pack-quantized` W8A16 (8-bit, channel or group). Each comes with the weights
dequantized (`q * scale`, fp32), which a float folder of the same model holds."""

from __future__ import annotations

from pathlib import Path

import torch
from safetensors.torch import load_file

from tests.model.quantization._quantized_checkpoints import pack, write_pair
from tests.support.tiny_models import GREEDY_STABLE, save_tiny_hf

PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
FP8 = torch.float8_e4m3fn
STATIC_INPUT_SCALE = 0.02  # static activations: x / 0.02 spans the int8 range for the tiny model's activations


def _args(kind: str, num_bits: int = 8, strategy: str = "channel", **kw) -> dict:
    return {"num_bits": num_bits, "type": kind, "symmetric": True, "strategy": strategy, "dynamic": False,
            "group_size": None, "actorder": None, **kw}


def ct_config(scheme: str, ignore: list[str], group_size: int = 32) -> dict:
    """The `quantization_config` llm-compressor writes for `scheme`."""
    fmt, weights, acts = {
        "w8a8": ("int-quantized", _args("int"), _args("int", strategy="token", dynamic=True)),
        "w8a8_static": ("int-quantized", _args("int", strategy="tensor"), _args("int", strategy="tensor")),
        "fp8": ("float-quantized", _args("float"), _args("float", strategy="token", dynamic=True)),
        "fp8_static": ("float-quantized", _args("float", strategy="tensor"), _args("float", strategy="tensor")),
        "w8a16": ("pack-quantized", _args("int"), None),
        "w8a16_group": ("pack-quantized", _args("int", strategy="group", group_size=group_size), None),
    }[scheme]
    return {"quant_method": "compressed-tensors", "format": fmt, "ignore": ignore, "kv_cache_scheme": None,
            "quantization_status": "compressed", "config_groups": {"group_0": {
                "targets": ["Linear"], "format": fmt, "weights": weights, "input_activations": acts,
                "output_activations": None}}}


def _quantize(w: torch.Tensor, scheme: str, group_size: int) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    """({suffix: tensor} as written on disk, the dequantized fp32 weight)."""
    n, k = w.shape
    if scheme in ("w8a8_static", "fp8_static"):  # strategy "tensor"
        amax = w.abs().amax().reshape(1)
    elif scheme == "w8a16_group":
        amax = w.reshape(n, k // group_size, group_size).abs().amax(-1)  # [N, G]
    else:
        amax = w.abs().amax(1, keepdim=True)  # [N, 1]
    if scheme.startswith("fp8"):
        scale = amax / 448.0
        q = (w / scale).clamp(-448, 448).to(FP8)
        parts = {"weight": q, "weight_scale": scale}
        if scheme == "fp8_static":
            parts["input_scale"] = torch.tensor([STATIC_INPUT_SCALE])
        return parts, q.float() * scale
    scale = amax / 127.0
    full = scale.repeat_interleave(group_size, dim=1) if scheme == "w8a16_group" else scale
    q = (w / full).round().clamp(-128, 127)
    if scheme.startswith("w8a16"):  # packed 4 a word, stored as q + 128
        parts = {"weight_packed": pack((q + 128).to(torch.int64), 1, bits=8), "weight_scale": scale,
                 "weight_shape": torch.tensor([n, k], dtype=torch.int32)}
    else:
        parts = {"weight": q.to(torch.int8), "weight_scale": scale}
        if scheme == "w8a8_static":
            parts["input_scale"] = torch.tensor([STATIC_INPUT_SCALE])
    return parts, q * full


def build_ct(root: Path, scheme: str, *, ignore: tuple[str, ...] = ("lm_head",), keep_float: tuple[str, ...] = (),
             group_size: int = 32, seed: int = 0, **overrides) -> tuple[Path, Path]:
    """Write `(compressed-tensors folder, dequantized fp32 folder)` under `root`. Modules named in
    `keep_float` (checkpoint prefixes) are written in float, as llm-compressor writes ignored modules."""
    src, quant, deq = root / "src", root / scheme, root / "dequantized"
    save_tiny_hf(src, "llama", seed=seed, **{**GREEDY_STABLE, "tie_word_embeddings": False, **overrides})
    state = load_file(str(src / "model.safetensors"))
    qstate, dstate = {}, {}
    for name, w in state.items():
        parts = name.split(".")
        prefix = name[: -len(".weight")]
        if len(parts) < 3 or parts[-2] not in PROJECTIONS or parts[-1] != "weight" or prefix in keep_float:
            qstate[name] = dstate[name] = w
            continue
        written, dq = _quantize(w.float(), scheme, group_size)
        qstate.update({f"{prefix}.{suffix}": t.contiguous() for suffix, t in written.items()})
        dstate[name] = dq.contiguous()
    qc = ct_config(scheme, list(ignore), group_size)
    write_pair(src, quant, qstate, deq, dstate, qc)
    return quant, deq
