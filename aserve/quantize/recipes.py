"""Quantization types of `aserve quantize` -> llm-compressor recipes (lists of modifiers).

  type              weights                                activations                 algorithm
  gptq              int4, symmetric, groups of --group-size  bf16/fp16                GPTQ (calibrated)
  awq               int4, asymmetric (zero points), groups   bf16/fp16                AWQ scales + RTN (calibrated)
  weight_only_int8  int8, symmetric, per output channel      bf16/fp16                round-to-nearest (no data)
  smooth_quant      int8, symmetric, per output channel      int8, dynamic per token  SmoothQuant (--sq) + GPTQ
  fp8               float8_e4m3fn, per output channel        fp8, dynamic per token   round-to-nearest (no data)

The LM head stays unquantized in every type (as llm-compressor's and vLLM's examples leave it).
llm-compressor is imported only when a recipe is built (`pip install 'aserve[quantize]'`).
"""

from __future__ import annotations

from typing import Any

QUANT_TYPES = ("weight_only_int8", "smooth_quant", "awq", "gptq", "fp8")
CALIBRATED_TYPES = frozenset({"smooth_quant", "awq", "gptq"})
GROUPED_TYPES = frozenset({"awq", "gptq"})  # --group-size applies to these
IGNORED_MODULES = ("lm_head",)
MISSING_LIBRARY = ("aserve quantize needs llm-compressor, which is not installed: "
                   "pip install 'aserve[quantize]' (or pip install llmcompressor)")


def _int_weights(bits: int, symmetric: bool, group_size: int) -> dict[str, Any]:
    if group_size == -1:
        return {"num_bits": bits, "type": "int", "symmetric": symmetric, "strategy": "channel"}
    return {"num_bits": bits, "type": "int", "symmetric": symmetric, "strategy": "group", "group_size": group_size}


def build_recipe(quant_type: str, group_size: int, smoothing_strength: float) -> list[Any]:
    """The modifiers for `quant_type` (see the module docstring). Raises ImportError with
    `MISSING_LIBRARY` when llm-compressor is not installed."""
    try:
        from compressed_tensors.quantization import QuantizationArgs, QuantizationScheme
        from llmcompressor.modifiers.quantization import GPTQModifier, QuantizationModifier
        from llmcompressor.modifiers.transform.awq import AWQModifier
        from llmcompressor.modifiers.transform.smoothquant import SmoothQuantModifier
    except ImportError as exc:
        raise ImportError(MISSING_LIBRARY) from exc

    def groups(weights: dict[str, Any], activations: dict[str, Any] | None = None) -> dict[str, Any]:
        scheme = QuantizationScheme(targets=["Linear"], weights=QuantizationArgs(**weights),
                                    input_activations=None if activations is None else QuantizationArgs(**activations))
        return {"group_0": scheme}

    ignore = list(IGNORED_MODULES)
    if quant_type == "gptq":
        return [GPTQModifier(config_groups=groups(_int_weights(4, True, group_size)), ignore=ignore)]
    if quant_type == "awq":
        return [AWQModifier(duo_scaling="both"),  # searches scales for the quantization that follows it
                QuantizationModifier(config_groups=groups(_int_weights(4, False, group_size)), ignore=ignore)]
    if quant_type == "weight_only_int8":
        return [QuantizationModifier(config_groups=groups(_int_weights(8, True, -1)), ignore=ignore)]
    if quant_type == "smooth_quant":
        per_token = {"num_bits": 8, "type": "int", "symmetric": True, "strategy": "token", "dynamic": True}
        return [SmoothQuantModifier(smoothing_strength=smoothing_strength),
                GPTQModifier(config_groups=groups(_int_weights(8, True, -1), per_token), ignore=ignore)]
    if quant_type == "fp8":
        return [QuantizationModifier(scheme="FP8_DYNAMIC", targets=["Linear"], ignore=ignore)]
    raise ValueError(f"unknown quantization type {quant_type!r}; choose from {QUANT_TYPES}")
