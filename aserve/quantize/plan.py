"""`QuantizePlan`: an `aserve quantize` request, every argument checked before any weight is read.

`make_plan(args)` resolves the input like `--model` does (a folder, a `.gguf` file, the bundled model's
names), reads its config.json and tokenizer, builds the model's layer shapes on the meta device (no
weights), and checks: the output folder, the architecture, `--group-size` against every quantized
Linear's input size and its `-tp` shards (without the flag: the first of 128, 64, 32 that fits), `-tp`
against the head and MLP sizes, `--multi-query-mode`, `--sq`, and the calibration data. `PlanError` (a
ValueError) names the argument at fault.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from aserve.config import SUPPORTED_ARCHITECTURES
from aserve.quantize import calibration
from aserve.quantize.recipes import CALIBRATED_TYPES, GROUPED_TYPES, IGNORED_MODULES, QUANT_TYPES

# Served families whose result aserve serves: GPT-2 keeps its projections in Conv1D modules (llm-compressor
# quantizes Linear only) and quantized MoE experts are not served.
UNQUANTIZABLE = {
    "GPT2LMHeadModel": "its projections are Conv1D modules, which llm-compressor does not quantize",
    "MixtralForCausalLM": "quantized MoE experts are not served by aserve yet",
    "Qwen2MoeForCausalLM": "quantized MoE experts are not served by aserve yet",
    "Qwen3MoeForCausalLM": "quantized MoE experts are not served by aserve yet",
}
QUANTIZABLE_ARCHITECTURES = tuple(sorted(SUPPORTED_ARCHITECTURES - UNQUANTIZABLE.keys()))
# Linear layers whose *input* is split across tensor-parallel ranks (row-parallel) in every family served.
ROW_PARALLEL_SUFFIXES = ("o_proj", "down_proj", "out_proj", "fc2", "dense")
DEFAULT_GROUP_SIZES = (128, 64, 32)  # without --group-size: the first that divides every input (and shard)
DTYPES = {"bf16": "bfloat16", "bfloat16": "bfloat16", "fp16": "float16", "float16": "float16",
          "half": "float16", "fp32": "float32", "float32": "float32", "float": "float32"}


class PlanError(ValueError):
    """An `aserve quantize` argument that cannot be used; the message names it."""


@dataclass(frozen=True)
class QuantizePlan:
    input_path: str  # a local folder with config.json, tokenizer files and float weights
    output_path: str
    quant_type: str
    dtype: str  # "bfloat16" | "float16" | "float32": the unquantized parts' dtype (and calibration's)
    group_size: int  # gptq / awq; -1: one group per output channel
    smoothing_strength: float  # smooth_quant
    calibration: tuple[tuple[int, ...], ...]  # empty for the types that need no data
    calibration_source: str
    max_seq_length: int
    tensor_parallel_size: int
    architecture: str


def _load_config(input_path: str) -> dict[str, Any]:
    try:
        return json.loads((Path(input_path) / "config.json").read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise PlanError(f"-i: {input_path} has no readable config.json ({exc})") from None


def _check_output(output: str, input_path: str) -> str:
    out = os.path.abspath(os.path.expanduser(output))
    if os.path.exists(out) and (not os.path.isdir(out) or os.listdir(out)):
        raise PlanError(f"-o: {output} exists and is not an empty folder; choose a new output folder")
    if os.path.abspath(input_path) == out:
        raise PlanError("-o: the output folder is the input folder")
    parent = os.path.dirname(out) or "."
    if not os.path.isdir(parent):
        raise PlanError(f"-o: the parent folder {parent} does not exist")
    return out


def quantized_linear_inputs(input_path: str) -> dict[str, int]:
    """{module name: input size} of every Linear llm-compressor quantizes (the LM head left out), from
    the model built on the meta device (no weights read)."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(input_path)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    return {name: m.in_features for name, m in model.named_modules()
            if isinstance(m, torch.nn.Linear) and name.rsplit(".", 1)[-1] not in IGNORED_MODULES}


def _check_shapes(args, cfg: dict[str, Any], inputs: dict[str, int]) -> int:
    """The group size to use (-1 for the per-channel types), after checking it and `-tp` against `inputs`."""
    tp = args.tensor_parallel_size
    heads = int(cfg.get("num_attention_heads") or 0)
    kv_heads = int(cfg.get("num_key_value_heads") or heads)
    if tp < 1 or (heads and heads % tp):
        raise PlanError(f"-tp {tp}: the model's {heads} attention heads do not split over {tp} GPUs")
    if args.multi_query_mode and kv_heads >= heads:
        raise PlanError(f"--multi-query-mode: the model has {kv_heads} key/value heads for {heads} query heads "
                        "(not multi-query / grouped-query attention); drop the flag")
    gs = args.group_size if args.quant_type in GROUPED_TYPES else -1
    if gs != -1 and not args.group_size_given:  # the default: 128 where it fits, else 64 or 32
        def shard(name: str, k: int) -> int:
            return k // tp if name.rsplit(".", 1)[-1] in ROW_PARALLEL_SUFFIXES else k

        gs = next((g for g in DEFAULT_GROUP_SIZES if all(shard(n, k) % g == 0 for n, k in inputs.items())), gs)
    for name, k in inputs.items():
        row_parallel = name.rsplit(".", 1)[-1] in ROW_PARALLEL_SUFFIXES
        shard = k // tp if row_parallel else k
        if row_parallel and k % tp:
            raise PlanError(f"-tp {tp}: {name} has {k} inputs, which do not split over {tp} GPUs")
        if gs != -1 and shard % gs:
            what = f"{name}'s {k} inputs" + (f" ({shard} per GPU at -tp {tp})" if row_parallel and tp > 1 else "")
            raise PlanError(f"--group-size {gs}: {what} are not a multiple of it; choose a divisor, or -1 "
                            "for one group per output channel")
    return gs


def _calibration(args, tokenizer, vocab_size: int) -> tuple[list[list[int]], str]:
    if args.quant_type not in CALIBRATED_TYPES:
        for flag, value in (("--calib-token-ids", args.calib_token_ids), ("--calib-dataset", args.calib_dataset)):
            if value is not None:
                raise PlanError(f"{flag}: --quant-type {args.quant_type} needs no calibration data "
                                f"(calibrated types: {sorted(CALIBRATED_TYPES)})")
        return [], "none"
    if args.calib_token_ids is not None and args.calib_dataset is not None:
        raise PlanError("--calib-token-ids and --calib-dataset: give one calibration source, not both")
    if args.calib_token_ids is not None:
        sequences, source = calibration.read_token_id_file(args.calib_token_ids, vocab_size), args.calib_token_ids
    elif args.calib_dataset is not None:
        sequences, source = calibration.read_jsonl(args.calib_dataset, tokenizer), args.calib_dataset
    else:
        sequences, source = calibration.default_sequences(tokenizer), "built-in set"
    return calibration.select(sequences, args.num_calib_samples, args.max_seq_length), source


def make_plan(args) -> QuantizePlan:
    """The checked plan of parsed `aserve quantize` arguments (see the module docstring)."""
    from aserve.model_source import ModelSourceError, resolve_model

    if args.quant_type not in QUANT_TYPES:
        raise PlanError(f"--quant-type: {args.quant_type!r} is not one of {QUANT_TYPES}")
    if args.smoothing_strength is not None and args.quant_type != "smooth_quant":
        raise PlanError(f"-sq: the smoothing strength applies to --quant-type smooth_quant only, not {args.quant_type}")
    sq = 0.8 if args.smoothing_strength is None else args.smoothing_strength
    if not 0.0 <= sq <= 1.0:
        raise PlanError(f"-sq: {sq} is outside 0..1")
    if args.group_size_given and args.quant_type not in GROUPED_TYPES:
        raise PlanError(f"--group-size: applies to {sorted(GROUPED_TYPES)}; {args.quant_type} weights have one "
                        "scale per output channel")
    if args.group_size == 0 or args.group_size < -1:
        raise PlanError(f"--group-size: {args.group_size} must be positive, or -1 for one group per output channel")
    for flag, value in (("--num-calib-samples", args.num_calib_samples), ("--max-seq-length", args.max_seq_length)):
        if value < 1:
            raise PlanError(f"{flag}: must be at least 1, got {value}")
    try:
        input_path = resolve_model(args.input)
    except ModelSourceError as exc:
        raise PlanError(f"-i: {exc}") from None
    cfg = _load_config(input_path)
    architecture = (cfg.get("architectures") or ["?"])[0]
    if architecture in UNQUANTIZABLE:
        raise PlanError(f"-i: {architecture} cannot be quantized here: {UNQUANTIZABLE[architecture]}")
    if architecture not in QUANTIZABLE_ARCHITECTURES:
        raise PlanError(f"-i: architecture {architecture!r} is not supported; supported: {list(QUANTIZABLE_ARCHITECTURES)}")
    output = _check_output(args.output, input_path)
    if args.dtype == "auto":  # the checkpoint's half dtype, else bf16
        dtype = DTYPES.get(str(cfg.get("torch_dtype") or cfg.get("dtype") or "").lower(), "bfloat16")
        dtype = dtype if dtype in ("bfloat16", "float16") else "bfloat16"
    else:
        dtype = DTYPES.get(str(args.dtype).lower())
    if dtype is None:
        raise PlanError(f"-t: {args.dtype!r} is not one of fp16, bf16 (or fp32, auto)")
    group_size = _check_shapes(args, cfg, quantized_linear_inputs(input_path))
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(input_path)
    sequences, source = _calibration(args, tokenizer, int(cfg.get("vocab_size") or len(tokenizer)))
    return QuantizePlan(input_path, output, args.quant_type, dtype, group_size, sq,
                        tuple(tuple(s) for s in sequences), source, args.max_seq_length, args.tensor_parallel_size,
                        architecture)
