"""Carrying out a `QuantizePlan`: load the float model, run llm-compressor's `oneshot` with the type's
recipe over the calibration sequences (its own progress bars show the calibration passes, layer by
layer), and save a compressed-tensors checkpoint with the tokenizer beside it.

Runs on the CPU, or on CUDA when torch sees a GPU (llm-compressor moves each layer to it in turn).
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from aserve.quantize.plan import QuantizePlan
from aserve.quantize.recipes import build_recipe

logger = logging.getLogger("aserve.quantize")


@dataclass(frozen=True)
class QuantizeResult:
    output_path: str
    seconds: float
    checkpoint_bytes: int  # the safetensors files written
    num_calibration_sequences: int


@contextlib.contextmanager
def _without_pinned_memory() -> Iterator[None]:
    """llm-compressor 0.14's AWQ pins its cached activations for GPU transfers, which raises on a machine
    without an accelerator; on such a machine pinning is skipped for the duration of the run. (The one
    patch of a library class in aserve: it has no option for this; the original is restored on exit, and
    `aserve quantize` runs one quantization per process.)"""
    import torch
    from llmcompressor.pipelines.cache import IntermediatesCache

    if torch.cuda.is_available():
        yield
        return
    original = IntermediatesCache.pin_memory
    IntermediatesCache.pin_memory = lambda self, *args, **kwargs: None
    try:
        yield
    finally:
        IntermediatesCache.pin_memory = original


def _calibration_dataset(sequences):
    from datasets import Dataset

    ids = [list(s) for s in sequences]
    return Dataset.from_dict({"input_ids": ids, "attention_mask": [[1] * len(s) for s in ids]})


def quantize(plan: QuantizePlan) -> QuantizeResult:
    """Quantize `plan.input_path` into `plan.output_path` (created); returns what was written."""
    import torch
    from llmcompressor import oneshot
    from transformers import AutoModelForCausalLM, AutoTokenizer

    started = time.monotonic()
    recipe = build_recipe(plan.quant_type, plan.group_size, plan.smoothing_strength)
    logger.info("loading %s (%s) in %s", plan.input_path, plan.architecture, plan.dtype)
    tokenizer = AutoTokenizer.from_pretrained(plan.input_path)
    model = AutoModelForCausalLM.from_pretrained(plan.input_path, dtype=getattr(torch, plan.dtype))
    model.eval()
    kwargs = {}
    if plan.calibration:
        kwargs = {"dataset": _calibration_dataset(plan.calibration), "num_calibration_samples": len(plan.calibration),
                      "max_seq_length": plan.max_seq_length, "shuffle_calibration_samples": False}
        logger.info("calibrating on %d sequences (%d tokens) from %s", len(plan.calibration),
                    sum(map(len, plan.calibration)), plan.calibration_source)
    with _without_pinned_memory():
        oneshot(model=model, processor=tokenizer, recipe=recipe, **kwargs)
    Path(plan.output_path).mkdir(parents=True, exist_ok=True)
    model.save_pretrained(plan.output_path, save_compressed=True)
    tokenizer.save_pretrained(plan.output_path)
    written = sum(p.stat().st_size for p in Path(plan.output_path).glob("*.safetensors"))
    return QuantizeResult(plan.output_path, time.monotonic() - started, written, len(plan.calibration))
