"""Which quantization method serves a model: `--quantization` / `-q` and the checkpoint's own
`quantization_config` (config.json, or a `quantize_config.json` / `quant_config.json` beside it), read
into a frozen `QuantSpec` at start-up so a format or option that is not built is refused before any
weight is read.

Methods (the README's quantization table lists each with its kernel and test):
  checkpoint formats  gptq (4-bit; 8-bit channel-wise symmetric on the int8 kernel, other 8-bit served
                      dequantized), awq (GEMM packing), fp8 (float8_e4m3fn weights, per-tensor /
                      per-channel / `weight_block_size` scales), compressed-tensors (one config group
                      targeting Linear), by its `format`:
                        `pack-quantized`   W4A16 / W8A16 int weights, group / channel strategy (spec method
                                           "compressed-tensors"; 8-bit channel-wise symmetric layers on the
                                           int8 weight-only kernel, `_weight_int8pack_mm`)
                        `int-quantized`    W8A8 int8 (SmoothQuant / GPTQ W8A8): int8 weights, channel or
                                           tensor scales, symmetric int8 activations, dynamic per token or
                                           static per tensor (`input_scale`); spec method "w8a8", served by
                                           `aserve/model/quantization/w8a8.py` (`torch._int_mm`)
                        `float-quantized`  FP8 (FP8_DYNAMIC / FP8 / FP8_BLOCK): spec method "fp8", served as
                                           `quant_method: fp8` checkpoints are (weight-only on CPU)
                      `ignore` entries are module names, or `re:<regex>` matched from the name's start.
                      bitsandbytes (transformers' 4-bit nf4 / fp4, double quant or not, and LLM.int8()
                      8-bit; needs the `bitsandbytes` package: aserve/model/quantization/bitsandbytes.py)
  load-time           int4, int8 (`weight_only_int8` is seed 004's name for int8), gguf, fp8 (online
                      `--quantization fp8` of a float checkpoint), bitsandbytes (in-flight NF4, as vLLM;
                      `--load-format bitsandbytes` implies it)
`-q smooth_quant` (seed 004's name) names a compressed-tensors W8A8 int8 checkpoint; `-q weight_only_int8`
also accepts a compressed-tensors 8-bit weight-only one. Everything else named here is refused with the
reason.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from aserve.config.errors import ConfigError, require

CHECKPOINT_METHODS = ("gptq", "awq", "compressed-tensors", "fp8", "bitsandbytes")
LOAD_TIME_METHODS = ("gguf", "int4", "int8", "fp8", "bitsandbytes")
BITSANDBYTES_INSTALL = "pip install bitsandbytes"
# Resolved methods with a CUDA path (aserve/model/quantization/cuda_linear.py: the Triton dequant-GEMM,
# torch._int_mm, torch._scaled_mm); every other method is CPU only and refused with --device cuda, naming it.
CUDA_METHODS = ("gptq", "awq", "compressed-tensors", "fp8")
# `--quantization` names that are CPU only whatever the checkpoint (refused before any model work on CUDA);
# int8 / weight_only_int8 may name a compressed-tensors W8A16 checkpoint, so they wait for the checkpoint.
CPU_ONLY_FLAGS = ("gguf", "int4", "bitsandbytes")


def cuda_refusal(method: str) -> str:
    """Why `method` is refused with --device cuda."""
    return (f"{method!r} is implemented for CPU only (no CUDA kernel yet; CUDA serves {', '.join(CUDA_METHODS)} "
            "checkpoints and online fp8); pass --device cpu")


# Other spellings of a built method: seed 004's vendor name, vLLM's GPU-kernel names of the same formats.
METHOD_ALIASES = {"weight_only_int8": "int8", "gptq_marlin": "gptq", "awq_marlin": "awq",
                  "compressed_tensors": "compressed-tensors"}
# Known names that are not built, with why (refused at start-up, naming them).
REFUSED_METHODS = {
    "fbgemm_fp8": "FBGEMM FP8 checkpoints are not implemented (quant_method 'fp8' checkpoints are)",
    "squeezellm": "SqueezeLLM is not implemented",
    "aqlm": "AQLM is not implemented", "hqq": "HQQ is not implemented", "exl2": "EXL2 is not implemented",
    "marlin": "the Marlin checkpoint format is not implemented (use the GPTQ checkpoint it was made from)",
    "gptq_marlin_24": "2:4-sparse GPTQ is not implemented",
    "deepspeedfp": "DeepSpeed FP is not implemented", "experts_int8": "experts_int8 is not implemented",
    "modelopt": "ModelOpt checkpoints are not implemented", "quark": "Quark checkpoints are not implemented",
}
# Seed 004's name of a checkpoint kind: accepted as `--quantization` with such a checkpoint only.
SMOOTH_QUANT = "smooth_quant"
SMOOTH_QUANT_HOWTO = ("SmoothQuant needs a W8A8 checkpoint (compressed-tensors int-quantized); make one with "
                      "`aserve quantize -i MODEL -o OUT --quant-type smooth_quant` and serve OUT")
ALL_METHOD_NAMES = (*CHECKPOINT_METHODS, *LOAD_TIME_METHODS, *METHOD_ALIASES, SMOOTH_QUANT, *REFUSED_METHODS)
_SIDE_FILES = ("quantize_config.json", "quant_config.json")


@dataclass(frozen=True)
class QuantSpec:
    """A checkpoint format's parameters, validated. Weights: `w = (q - zero) * scale` per group of
    `group_size` input columns (-1: one group over the whole input), `q` in 0..2**bits-1."""

    # Which reader / Linear method serves it: "gptq" | "awq" | "compressed-tensors" (pack-quantized int) |
    # "fp8" (fp8 checkpoints, compressed-tensors float-quantized) | "w8a8" (compressed-tensors int-quantized).
    method: str
    bits: int
    group_size: int
    desc_act: bool = False  # gptq: g_idx orders the input columns (act-order)
    sym: bool = True
    gptq_v1_zeros: bool = False  # gptq v1 checkpoints store zero - 1
    # Module names left in float (AWQ's modules_to_not_convert, fp8's ignored_layers, c-t's ignore); an
    # entry "re:<regex>" names every module the regex matches from the start of its name (`ignores`).
    ignore: tuple[str, ...] = ()
    block_size: tuple[int, int] | None = None  # fp8: weight_block_size [rows, cols] of the block scales
    # fp8: "dynamic" | "static" (activations stay unquantized on CPU); w8a8: "dynamic" (int8 per token) |
    # "static" (int8 per tensor, the checkpoint's `input_scale`).
    activation_scheme: str = ""
    # bitsandbytes 4-bit: "nf4" | "fp4" (bnb_4bit_quant_type); each tensor's quant state names its own too.
    quant_type: str = ""

    def ignores(self, module: str) -> bool:
        """Whether checkpoint module name `module` is named by `ignore` (equal, or an `re:` entry's regex
        matches at its start, as vLLM and compressed-tensors match)."""
        return any(re.match(entry[3:], module) if entry.startswith("re:") else entry == module
                   for entry in self.ignore)


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
        if flagged in ("fp8", "bitsandbytes"):  # online: quantize the float checkpoint's Linear weights at load
            if flagged == "bitsandbytes":
                _require_bitsandbytes("--quantization bitsandbytes (in-flight NF4)")
            return flagged, None
        require(flagged != SMOOTH_QUANT, "quantization",
                f"{flag!r}: {model_path} is a float checkpoint (no quantization_config); {SMOOTH_QUANT_HOWTO}")
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
    parse = {"gptq": _gptq_spec, "awq": _awq_spec, "compressed-tensors": _compressed_tensors_spec,
             "fp8": _fp8_spec, "bitsandbytes": _bitsandbytes_spec}[ckpt]
    spec = parse(qc)
    if ckpt == "bitsandbytes":
        _require_bitsandbytes("a bitsandbytes checkpoint (config.json quantization_config)")
    if flagged is not None and not _flag_fits(flagged, ckpt, spec):
        fmt = f" ({qc.get('format')!r} format)" if ckpt == "compressed-tensors" else ""
        hint = f"; {SMOOTH_QUANT_HOWTO}" if flagged == SMOOTH_QUANT else ""
        raise ConfigError(f"--quantization {flag!r} does not match the checkpoint's quant_method {ckpt!r}{fmt} "
                          f"(config.json quantization_config); drop the flag or pass --quantization {ckpt}{hint}")
    require(tensor_parallel_size == 1, "quantization",
            f"{ckpt!r} checkpoints are not implemented with --tensor-parallel-size > 1 yet")
    return ckpt, spec


def _flag_fits(flagged: str, ckpt: str, spec: QuantSpec) -> bool:
    """Whether `--quantization` (normalized) names checkpoint `ckpt` parsed as `spec`: its own method, or
    a name of the scheme it holds (smooth_quant: W8A8 int8; int8 / weight_only_int8: 8-bit weight-only
    int; fp8: a compressed-tensors FP8 checkpoint)."""
    if flagged == ckpt:
        return True
    if ckpt != "compressed-tensors":
        return False
    return {SMOOTH_QUANT: spec.method == "w8a8", "int8": spec.method == ckpt and spec.bits == 8,
            "fp8": spec.method == "fp8"}.get(flagged, False)


def _refuse(method: str, what: str) -> ConfigError:
    return ConfigError(f"config.json quantization_config ({method}): {what} is not implemented")


def _check_kv_cache_scheme(scheme: Any) -> None:
    """compressed-tensors' `kv_cache_scheme`: built is 8-bit float, one static scale per layer (strategy
    tensor): the checkpoint's `k_scale` / `v_scale` tensors, used with `--kv-cache-dtype fp8`."""
    if not isinstance(scheme, dict):
        raise _refuse("compressed-tensors", f"kv_cache_scheme {scheme!r}")
    bits, kind = int(scheme.get("num_bits", 0) or 0), str(scheme.get("type", ""))
    strategy = str(scheme.get("strategy", "tensor"))
    if bits != 8 or kind != "float" or strategy != "tensor" or scheme.get("dynamic"):
        raise _refuse("compressed-tensors", f"kv_cache_scheme {kind} {bits}-bit, strategy {strategy!r}"
                      f"{', dynamic' if scheme.get('dynamic') else ''} (built: float 8-bit, strategy 'tensor', static: "
                      "fp8 KV-cache scales per layer)")


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
    groups = qc.get("config_groups") or {}
    if len(groups) != 1:
        raise _refuse("compressed-tensors", f"{len(groups)} config_groups (built: one)")
    (group,) = groups.values()
    fmt = str(group.get("format") or qc.get("format") or "").lower()
    if fmt not in _CT_FORMATS:
        raise _refuse("compressed-tensors", f"format {fmt!r} (built: {', '.join(map(repr, _CT_FORMATS))})")
    targets = group.get("targets") or ["Linear"]
    if list(targets) != ["Linear"]:
        raise _refuse("compressed-tensors", f"targets {targets} (built: ['Linear'])")
    if group.get("output_activations"):
        raise _refuse("compressed-tensors", "output_activations")
    if qc.get("kv_cache_scheme"):  # per-layer fp8 KV scales in the checkpoint (aserve/model/kv_scales.py)
        _check_kv_cache_scheme(qc["kv_cache_scheme"])
    ignore = tuple(str(entry) for entry in qc.get("ignore") or ())
    for entry in ignore:
        if entry.startswith("re:"):
            try:
                re.compile(entry[3:])
            except re.error as exc:
                raise ConfigError(f"config.json quantization_config (compressed-tensors): ignore entry {entry!r} "
                                  f"is not a valid regex ({exc})") from None
    w = group.get("weights") or {}
    if w.get("dynamic"):
        raise _refuse("compressed-tensors", "dynamic weight quantization")
    if w.get("actorder") not in (None, False, "static"):
        raise _refuse("compressed-tensors", f"actorder {w.get('actorder')!r}")
    return _CT_FORMATS[fmt](group, w, ignore)


def _ct_pack_quantized(group: dict[str, Any], w: dict[str, Any], ignore: tuple[str, ...]) -> QuantSpec:
    if group.get("input_activations"):
        raise _refuse("compressed-tensors", "activation quantization with pack-quantized weights (W4A8)")
    bits, kind, strategy = int(w.get("num_bits", 0)), str(w.get("type", "int")), str(w.get("strategy", ""))
    if kind != "int" or bits not in (4, 8):
        raise _refuse("compressed-tensors", f"{kind} {bits}-bit pack-quantized weights (built: int 4 / 8)")
    if strategy not in ("group", "channel"):
        raise _refuse("compressed-tensors", f"weight strategy {strategy!r} (built: 'group', 'channel')")
    group_size = int(w.get("group_size") or -1) if strategy == "group" else -1
    return QuantSpec("compressed-tensors", bits, group_size, sym=bool(w.get("symmetric", True)), ignore=ignore)


def _ct_int_quantized(group: dict[str, Any], w: dict[str, Any], ignore: tuple[str, ...]) -> QuantSpec:
    bits, kind, strategy = int(w.get("num_bits", 0)), str(w.get("type", "int")), str(w.get("strategy", ""))
    if kind != "int" or bits != 8:
        raise _refuse("compressed-tensors", f"int-quantized {kind} {bits}-bit weights (built: int 8)")
    if not w.get("symmetric", True):
        raise _refuse("compressed-tensors", "asymmetric int-quantized weights (built: symmetric)")
    if strategy not in ("channel", "tensor"):
        raise _refuse("compressed-tensors", f"int-quantized weight strategy {strategy!r} (built: 'channel', 'tensor')")
    act = group.get("input_activations")
    if not act:
        raise _refuse("compressed-tensors", "int-quantized weights without input_activations (W8A16 as "
                      "pack-quantized is built)")
    a_bits, a_kind, a_strategy = int(act.get("num_bits", 0)), str(act.get("type", "int")), str(act.get("strategy", ""))
    if a_kind != "int" or a_bits != 8:
        raise _refuse("compressed-tensors", f"{a_kind} {a_bits}-bit input_activations with int8 weights "
                      "(built: int 8)")
    if not act.get("symmetric", True):
        raise _refuse("compressed-tensors", "asymmetric input_activations (built: symmetric)")
    dynamic = bool(act.get("dynamic", False))
    if (dynamic, a_strategy) not in ((True, "token"), (False, "tensor")):
        raise _refuse("compressed-tensors", f"{'dynamic' if dynamic else 'static'} input_activations with strategy "
                      f"{a_strategy!r} (built: dynamic 'token', static 'tensor')")
    return QuantSpec("w8a8", 8, -1, ignore=ignore, activation_scheme="dynamic" if dynamic else "static")


def _ct_float_quantized(group: dict[str, Any], w: dict[str, Any], ignore: tuple[str, ...]) -> QuantSpec:
    bits, kind, strategy = int(w.get("num_bits", 0)), str(w.get("type", "float")), str(w.get("strategy", ""))
    if kind != "float" or bits != 8:
        raise _refuse("compressed-tensors", f"float-quantized {kind} {bits}-bit weights (built: float 8, e4m3)")
    block = None
    if strategy == "block":
        structure = w.get("block_structure")
        if not isinstance(structure, (list, tuple)) or len(structure) != 2 or any(int(b) <= 0 for b in structure):
            raise ConfigError("config.json quantization_config (compressed-tensors): invalid block_structure "
                              f"{structure!r}")
        block = (int(structure[0]), int(structure[1]))
    elif strategy not in ("channel", "tensor"):
        raise _refuse("compressed-tensors", f"float-quantized weight strategy {strategy!r} "
                      "(built: 'channel', 'tensor', 'block')")
    act = group.get("input_activations")
    scheme = "dynamic"
    if act:
        if str(act.get("type", "float")) != "float" or int(act.get("num_bits", 0)) != 8:
            raise _refuse("compressed-tensors", f"{act.get('type')} {act.get('num_bits')}-bit input_activations "
                          "with fp8 weights (built: float 8)")
        scheme = "dynamic" if act.get("dynamic") else "static"
    return QuantSpec("fp8", 8, -1 if block is None else block[1], ignore=ignore, block_size=block,
                     activation_scheme=scheme)


_CT_FORMATS = {"pack-quantized": _ct_pack_quantized, "int-quantized": _ct_int_quantized,
               "float-quantized": _ct_float_quantized}


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


def _require_bitsandbytes(what: str) -> None:
    """ConfigError naming `pip install bitsandbytes` when the package is not installed (not imported here)."""
    import importlib.util

    if importlib.util.find_spec("bitsandbytes") is None:
        raise ConfigError(f"--quantization: {what} needs the bitsandbytes package, which is not installed "
                          f"({BITSANDBYTES_INSTALL})")


def _bitsandbytes_spec(qc: dict[str, Any]) -> QuantSpec:
    """transformers' `BitsAndBytesConfig`: 4-bit nf4 / fp4 (double quant or not, uint8 storage) or LLM.int8()
    8-bit; `llm_int8_skip_modules` are stored (and served) in float; `bnb_4bit_compute_dtype` is not used
    (activations are in --dtype)."""
    four, eight = bool(qc.get("load_in_4bit")), bool(qc.get("load_in_8bit"))
    if four == eight:
        raise _refuse("bitsandbytes", "load_in_4bit and load_in_8bit both true" if four else
                      "a config with neither load_in_4bit nor load_in_8bit")
    skip = tuple(str(m) for m in qc.get("llm_int8_skip_modules") or ())
    if eight:
        if qc.get("llm_int8_has_fp16_weight"):
            raise _refuse("bitsandbytes", "llm_int8_has_fp16_weight true (8-bit training weights)")
        return QuantSpec("bitsandbytes", 8, -1, ignore=skip)
    kind = str(qc.get("bnb_4bit_quant_type") or "fp4").lower()
    if kind not in ("nf4", "fp4"):
        raise _refuse("bitsandbytes", f"bnb_4bit_quant_type {kind!r} (built: 'nf4', 'fp4')")
    storage = str(qc.get("bnb_4bit_quant_storage") or "uint8").lower().removeprefix("torch.")
    if storage != "uint8":
        raise _refuse("bitsandbytes", f"bnb_4bit_quant_storage {storage!r} (built: 'uint8')")
    return QuantSpec("bitsandbytes", 4, 64, ignore=skip, quant_type=kind)
