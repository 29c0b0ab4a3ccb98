"""Which quantization method serves a model: `--quantization` / `-q` and the checkpoint's own
`quantization_config` (config.json, or a `quantize_config.json` / `quant_config.json` beside it), read
into a frozen `QuantSpec` at start-up so a format or option that is not built is refused before any
weight is read.

Methods (the README's quantization table lists each with its kernel and test):
  checkpoint formats  gptq (4-bit; 8-bit served dequantized), awq (GEMM packing), compressed-tensors
                      (`pack-quantized` W4A16 / W8A16, int weights, group / channel strategy), fp8
                      (float8_e4m3fn weights, per-tensor / per-channel / `weight_block_size` scales)
  load-time           int4, int8 (`weight_only_int8` is seed 004's name for int8), gguf, fp8 (online
                      `--quantization fp8` of a float checkpoint)
Everything else named here is refused with the reason.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from aserve.config.errors import ConfigError, require

CHECKPOINT_METHODS = ("gptq", "awq", "compressed-tensors", "fp8")
LOAD_TIME_METHODS = ("gguf", "int4", "int8", "fp8")
# Other spellings of a built method: seed 004's vendor name, vLLM's GPU-kernel names of the same formats.
METHOD_ALIASES = {"weight_only_int8": "int8", "gptq_marlin": "gptq", "awq_marlin": "awq",
                  "compressed_tensors": "compressed-tensors"}
# Known names that are not built, with why (refused at start-up, naming them).
REFUSED_METHODS = {
    "fbgemm_fp8": "FBGEMM FP8 checkpoints are not implemented (quant_method 'fp8' checkpoints are)",
    "bitsandbytes": "bitsandbytes (NF4 / int8) is not implemented yet",
    "smooth_quant": "W8A8 (SmoothQuant) is not implemented yet",
    "squeezellm": "SqueezeLLM is not implemented",
    "aqlm": "AQLM is not implemented", "hqq": "HQQ is not implemented", "exl2": "EXL2 is not implemented",
    "marlin": "the Marlin checkpoint format is not implemented (use the GPTQ checkpoint it was made from)",
    "gptq_marlin_24": "2:4-sparse GPTQ is not implemented",
    "deepspeedfp": "DeepSpeed FP is not implemented", "experts_int8": "experts_int8 is not implemented",
    "modelopt": "ModelOpt checkpoints are not implemented", "quark": "Quark checkpoints are not implemented",
}
ALL_METHOD_NAMES = (*CHECKPOINT_METHODS, *LOAD_TIME_METHODS, *METHOD_ALIASES, *REFUSED_METHODS)
_SIDE_FILES = ("quantize_config.json", "quant_config.json")


@dataclass(frozen=True)
class QuantSpec:
    """A checkpoint format's parameters, validated. Weights: `w = (q - zero) * scale` per group of
    `group_size` input columns (-1: one group over the whole input), `q` in 0..2**bits-1."""

    method: str  # "gptq" | "awq" | "compressed-tensors"
    bits: int
    group_size: int
    desc_act: bool = False  # gptq: g_idx orders the input columns (act-order)
    sym: bool = True
    gptq_v1_zeros: bool = False  # gptq v1 checkpoints store zero - 1
    ignore: tuple[str, ...] = ()  # module names left in float (AWQ's modules_to_not_convert, c-t's ignore)
    block_size: tuple[int, int] | None = None  # fp8: weight_block_size [rows, cols] of the block scales
    activation_scheme: str = ""  # fp8: "dynamic" | "static" (activations stay unquantized on CPU)


def normalize_method(name: str | None) -> str | None:
    """A `--quantization` value or `quant_method` in aserve's spelling (aliases resolved, lower case)."""
    if name is None:
        return None
    key = str(name).strip().lower()
    return METHOD_ALIASES.get(key, key)


def checkpoint_quantization_config(hf_cfg: dict[str, Any], model_path: str | None) -> dict[str, Any] | None:
    """config.json's `quantization_config`, else a `quantize_config.json` (AutoGPTQ: implies gptq) or
    `quant_config.json` (AutoAWQ: implies awq) beside it, else None."""
    qc = hf_cfg.get("quantization_config")
    if isinstance(qc, dict):
        return qc
    for name, implied in zip(_SIDE_FILES, ("gptq", "awq"), strict=True):
        path = Path(model_path or "") / name
        if model_path and path.is_file():
            try:
                side = json.loads(path.read_text())
            except json.JSONDecodeError as exc:
                raise ConfigError(f"--model: {path} is not valid JSON ({exc})") from None
            return {"quant_method": implied, **side}
    return None


def resolve_quantization(flag: str | None, hf_cfg: dict[str, Any], model_path: str | None,
                         tensor_parallel_size: int = 1) -> tuple[str | None, QuantSpec | None]:
    """(the method to serve with, the checkpoint format's spec or None). Raises ConfigError naming
    `--quantization` and the checkpoint's `quant_method` when they disagree, and naming the format /
    option when it is not built."""
    qc = checkpoint_quantization_config(hf_cfg, model_path)
    flagged = normalize_method(flag)
    if flagged in REFUSED_METHODS:
        raise ConfigError(f"--quantization: {flag!r}: {REFUSED_METHODS[flagged]}")
    if qc is None:
        if flagged == "fp8":  # online: quantize the float checkpoint's Linear weights at load
            return flagged, None
        require(flagged not in CHECKPOINT_METHODS, "quantization",
                f"{flag!r} needs a checkpoint quantized in that format, but {model_path} has no quantization_config "
                "in config.json (nor a quantize_config.json); for a float checkpoint use int4 / int8")
        return flagged, None
    ckpt = normalize_method(qc.get("quant_method") or "")
    if not ckpt:
        raise ConfigError("config.json quantization_config: no quant_method")
    if ckpt in REFUSED_METHODS:
        raise ConfigError(f"config.json quantization_config.quant_method {ckpt!r}: {REFUSED_METHODS[ckpt]}")
    if ckpt not in CHECKPOINT_METHODS:
        raise ConfigError(f"config.json quantization_config.quant_method {ckpt!r} is not implemented; "
                          f"implemented checkpoint formats: {CHECKPOINT_METHODS}")
    if flagged is not None and flagged != ckpt:
        raise ConfigError(f"--quantization {flag!r} does not match the checkpoint's quant_method {ckpt!r} "
                          f"(config.json quantization_config); drop the flag or pass --quantization {ckpt}")
    require(tensor_parallel_size == 1, "quantization",
            f"{ckpt!r} checkpoints are not implemented with --tensor-parallel-size > 1 yet")
    parse = {"gptq": _gptq_spec, "awq": _awq_spec, "compressed-tensors": _compressed_tensors_spec,
             "fp8": _fp8_spec}[ckpt]
    return ckpt, parse(qc)


def _refuse(method: str, what: str) -> ConfigError:
    return ConfigError(f"config.json quantization_config ({method}): {what} is not implemented")


def _gptq_spec(qc: dict[str, Any]) -> QuantSpec:
    bits = int(qc.get("bits", 4))
    if bits not in (4, 8):
        raise _refuse("gptq", f"bits {bits} (built: 4, and 8 served dequantized)")
    fmt = str(qc.get("checkpoint_format") or qc.get("format") or "gptq").lower()
    if fmt not in ("gptq", "gptq_v2"):
        raise _refuse("gptq", f"checkpoint_format {fmt!r} (built: 'gptq' (v1), 'gptq_v2')")
    group_size = int(qc.get("group_size", 128))
    if group_size == 0 or group_size < -1:
        raise ConfigError(f"config.json quantization_config (gptq): invalid group_size {group_size}")
    return QuantSpec("gptq", bits, group_size, desc_act=bool(qc.get("desc_act", False)), sym=bool(qc.get("sym", True)),
                     gptq_v1_zeros=fmt == "gptq", ignore=tuple(qc.get("modules_to_not_convert") or ()))


def _awq_spec(qc: dict[str, Any]) -> QuantSpec:
    bits = int(qc.get("bits", qc.get("w_bit", 4)))
    if bits != 4:
        raise _refuse("awq", f"bits {bits} (built: 4)")
    version = str(qc.get("version", "gemm")).lower()
    if version != "gemm":
        raise _refuse("awq", f"version {version!r} (built: 'gemm')")
    if not qc.get("zero_point", True):
        raise _refuse("awq", "zero_point false")
    group_size = int(qc.get("group_size", qc.get("q_group_size", 128)))
    if group_size <= 0 and group_size != -1:
        raise ConfigError(f"config.json quantization_config (awq): invalid group_size {group_size}")
    return QuantSpec("awq", 4, group_size, sym=False, ignore=tuple(qc.get("modules_to_not_convert") or ()))


def _compressed_tensors_spec(qc: dict[str, Any]) -> QuantSpec:
    fmt = str(qc.get("format", "")).lower()
    if fmt != "pack-quantized":
        raise _refuse("compressed-tensors", f"format {fmt!r} (built: 'pack-quantized' weight-only int)")
    groups = qc.get("config_groups") or {}
    if len(groups) != 1:
        raise _refuse("compressed-tensors", f"{len(groups)} config_groups (built: one)")
    (group,) = groups.values()
    if group.get("format") not in (None, "pack-quantized"):
        raise _refuse("compressed-tensors", f"config group format {group.get('format')!r}")
    targets = group.get("targets") or ["Linear"]
    if list(targets) != ["Linear"]:
        raise _refuse("compressed-tensors", f"targets {targets} (built: ['Linear'])")
    if group.get("input_activations") or group.get("output_activations"):
        raise _refuse("compressed-tensors", "activation quantization (W8A8 / FP8)")
    w = group.get("weights") or {}
    bits, kind, strategy = int(w.get("num_bits", 0)), str(w.get("type", "int")), str(w.get("strategy", ""))
    if kind != "int" or bits not in (4, 8):
        raise _refuse("compressed-tensors", f"{kind} {bits}-bit weights (built: int 4 / 8)")
    if strategy not in ("group", "channel"):
        raise _refuse("compressed-tensors", f"weight strategy {strategy!r} (built: 'group', 'channel')")
    if w.get("actorder") not in (None, False, "static"):
        raise _refuse("compressed-tensors", f"actorder {w.get('actorder')!r}")
    if w.get("dynamic"):
        raise _refuse("compressed-tensors", "dynamic weight quantization")
    group_size = int(w.get("group_size") or -1) if strategy == "group" else -1
    return QuantSpec("compressed-tensors", bits, group_size, sym=bool(w.get("symmetric", True)),
                     ignore=tuple(qc.get("ignore") or ()))


def _fp8_spec(qc: dict[str, Any]) -> QuantSpec:
    fmt = str(qc.get("fmt", "e4m3")).lower()
    if fmt != "e4m3":
        raise _refuse("fp8", f"fmt {fmt!r} (built: 'e4m3')")
    scheme = str(qc.get("activation_scheme", "dynamic")).lower()
    if scheme not in ("dynamic", "static"):
        raise _refuse("fp8", f"activation_scheme {scheme!r} (built: 'dynamic', 'static')")
    block = qc.get("weight_block_size")
    if block is not None:
        if not isinstance(block, (list, tuple)) or len(block) != 2 or any(int(b) <= 0 for b in block):
            raise ConfigError(f"config.json quantization_config (fp8): invalid weight_block_size {block!r}")
        block = (int(block[0]), int(block[1]))
    ignore = tuple(qc.get("ignored_layers") or qc.get("modules_to_not_convert") or ())
    return QuantSpec("fp8", 8, -1 if block is None else block[1], ignore=ignore, block_size=block,
                     activation_scheme=scheme)
