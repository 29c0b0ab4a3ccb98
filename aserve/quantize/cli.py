"""`aserve quantize -i IN -o OUT --quant-type TYPE [flags]`: returns the exit code (0 done, 2 bad arguments,
1 the quantization failed).

Seed 004's spellings are accepted beside the long ones: `-quant_type`, `-sq`, `-token` (and
`--tokenids_path`), `-tp`, `-t`, `--multi-query-mode`.
"""

from __future__ import annotations

import argparse
import logging
import sys

from aserve.quantize.recipes import MISSING_LIBRARY, QUANT_TYPES

DEFAULT_GROUP_SIZE = 128


def make_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="aserve quantize",
        description="Quantize a model's Linear weights with llm-compressor into a compressed-tensors checkpoint "
                    "that `aserve --model OUT` (and vLLM) serve with no quantization flag.")
    p.add_argument("-i", "--input", required=True, metavar="MODEL",
                   help="the float model: a folder, a .gguf file, or the bundled model's name (as --model takes)")
    p.add_argument("-o", "--output", required=True, metavar="FOLDER", help="where to write the checkpoint (new or empty)")
    p.add_argument("--quant-type", "-quant_type", dest="quant_type", required=True, choices=QUANT_TYPES,
                   help="weight_only_int8: int8 weights per channel; smooth_quant: W8A8 int8 with SmoothQuant; "
                        "awq / gptq: 4-bit weights in groups; fp8: FP8 weights and dynamic FP8 activations")
    p.add_argument("-t", "--dtype", default="auto",
                   help="dtype of the unquantized parts and of calibration: bf16, fp16 (or fp32); "
                        "default auto: the checkpoint's half dtype, else bf16")
    p.add_argument("-sq", "--sq", "--smoothing-strength", dest="smoothing_strength", type=float, default=None,
                   help="SmoothQuant's migration strength, 0..1 (smooth_quant only; default 0.8)")
    p.add_argument("--calib-token-ids", "-token", "--tokenids_path", dest="calib_token_ids", metavar="FILE",
                   help="calibration token ids: one sequence per line, ids separated by spaces or commas")
    p.add_argument("--calib-dataset", metavar="FILE.jsonl",
                   help="calibration texts: JSON Lines with `text`, `prompt` or `messages` (a chat) per line")
    p.add_argument("--num-calib-samples", type=int, default=64, help="calibration sequences used (default 64)")
    p.add_argument("--max-seq-length", type=int, default=512, help="tokens per calibration sequence (default 512)")
    p.add_argument("--group-size", type=int, default=None,
                   help="gptq / awq: input columns per scale (default: 128, or 64 or 32 where 128 does not divide "
                        "every layer's inputs; -1: one per output channel)")
    p.add_argument("-tp", "--tensor-parallel-size", type=int, default=1,
                   help="GPUs the result will be served on (e.g. by vLLM; aserve serves quantized checkpoints "
                        "at tensor-parallel size 1 today): the group size is checked against each GPU's shard")
    p.add_argument("--multi-query-mode", action="store_true",
                   help="the model uses multi-query / grouped-query attention (checked; SmoothQuant smooths q, k "
                        "and v from one norm either way)")
    p.add_argument("--log-level", default="info", choices=("debug", "info", "warning", "error"))
    return p


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = make_parser()
    args = parser.parse_args(argv)
    args.group_size_given = args.group_size is not None
    if args.group_size is None:
        args.group_size = DEFAULT_GROUP_SIZE
    return args


def main(argv: list[str]) -> int:
    """`argv` without the leading `quantize`."""
    args = parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), format="%(levelname)s %(asctime)s [%(name)s] %(message)s",
                        datefmt="%m-%d %H:%M:%S")
    from aserve.quantize.calibration import CalibrationError
    from aserve.quantize.plan import PlanError, make_plan

    try:
        import llmcompressor  # noqa: F401  (checked before any work)
    except ImportError:
        print(f"aserve quantize: error: {MISSING_LIBRARY}", file=sys.stderr)
        return 2
    try:
        plan = make_plan(args)
    except (PlanError, CalibrationError) as exc:
        print(f"aserve quantize: error: {exc}", file=sys.stderr)
        return 2
    from aserve.quantize.run import quantize

    try:
        result = quantize(plan)
    except Exception:  # the library failed mid-way: its traceback is the diagnosis
        logging.getLogger("aserve.quantize").exception("quantization failed")
        return 1
    print(f"aserve quantize: wrote {result.output_path} ({plan.quant_type}, {result.checkpoint_bytes / 2**20:.1f} MiB "
          f"of weights) in {result.seconds:.1f} s; serve it with: aserve --model {result.output_path}")
    return 0
