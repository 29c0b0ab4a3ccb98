"""fp8 KV-cache scales: where each attention layer's `k_scale` / `v_scale` come from.

An fp8 KV cache (`--kv-cache-dtype fp8 | fp8_e4m3 | fp8_e5m2`) stores `fp8(k / k_scale)` and
`fp8(v / v_scale)` and multiplies the scales back when it reads; each `Attention` layer holds its own
pair (aserve/model/layers/attention.py) and passes it to the backend. Three sources, as in vLLM:

  checkpoint  per-layer scalar tensors an FP8 / compressed-tensors (`kv_cache_scheme`) checkpoint carries:
              `<layer>.self_attn.k_scale` / `.v_scale`, `<layer>.self_attn.attn.k_scale`, ModelOpt's
              `<layer>.self_attn.k_proj.k_scale`, AutoFP8's `<layer>.self_attn.k_proj.output_scale`, and
              the older `<layer>.self_attn.kv_scale` (one scale for both); routed here by `load_weights`
  file        `--quantization-param-path`: vLLM's JSON, one scale per layer (K and V alike) per
              tensor-parallel rank (parsed and checked at start-up: aserve/config/kv_scales.py)
  calculated  `--calculate-kv-scales`: the first step the runner executes computes each layer's
              amax(|k|) / fp8 max and amax(|v|) / fp8 max, which then stay fixed

Without any of them the scales are 1.0 and the loader warns. Scales only apply to an fp8 cache: with
another cache dtype, checkpoint scales are ignored (logged) and every layer keeps 1.0.
"""

from __future__ import annotations

import logging
import math

import torch
from torch import nn

from aserve.model.layers.attention import Attention

logger = logging.getLogger(__name__)

# Checkpoint names that carry a query or softmax scale: used by vLLM's fp8 attention kernels on some
# GPUs; aserve keeps queries unquantized, so they are read and dropped.
_UNUSED_SUFFIXES = (".q_scale", ".prob_scale", ".q_proj.output_scale")
_SCALE_SUFFIXES = {  # suffix -> which scale(s); the rest of the name leads to the attention layer
    ".k_proj.output_scale": "k", ".v_proj.output_scale": "v",  # AutoFP8
    ".k_proj.k_scale": "k", ".v_proj.v_scale": "v",  # ModelOpt
    ".k_scale": "k", ".v_scale": "v", ".kv_scale": "kv",
}


def fp8_max(dtype: torch.dtype) -> float:
    return float(torch.finfo(dtype).max)


def calculated_scale(x: torch.Tensor, cache_dtype: torch.dtype) -> float:
    """amax(|x|) / the cache dtype's largest value (1.0 for an empty or all-zero x, or a non-fp8 cache)."""
    if cache_dtype.itemsize != 1 or x.numel() == 0:
        return 1.0
    amax = float(x.detach().abs().max().float())
    if not math.isfinite(amax) or amax <= 0.0:
        return 1.0
    return amax / fp8_max(cache_dtype)


def kv_scale_name(name: str) -> tuple[str, str | None] | None:
    """A checkpoint tensor name that holds a KV-cache scale -> (its attention module's prefix, "k" | "v" |
    "kv"), or (prefix, None) for a query / softmax scale that is not used; None for any other name."""
    for suffix in _UNUSED_SUFFIXES:
        if name.endswith(suffix):
            return name[: -len(suffix)], None
    for suffix, which in _SCALE_SUFFIXES.items():
        if name.endswith(suffix):
            return name[: -len(suffix)], which
    return None


def attention_owners(model: nn.Module) -> dict[str, Attention]:
    """Module prefix -> the attention layer a scale under it belongs to: each `Attention`'s own name
    (`model.layers.0.self_attn.attn`) and its parent's (`model.layers.0.self_attn`)."""
    owners: dict[str, Attention] = {}
    for name, module in model.named_modules():
        if isinstance(module, Attention):
            owners[name] = module
            if "." in name:
                owners.setdefault(name.rsplit(".", 1)[0], module)
    return owners


def load_kv_scale(owners: dict[str, Attention], original: str, name: str, tensor: torch.Tensor) -> bool:
    """If `name` (`original` in the checkpoint) is a KV-cache scale, set it on its attention layer and
    return True (also for the unused query / softmax scales); False for any other tensor. ValueError when
    no attention layer matches, or for a scale that is not one number (per-head scales are not built)."""
    found = kv_scale_name(name)
    if found is None:
        return False
    prefix, which = found
    if which is None:
        return True
    layer = owners.get(prefix)
    if layer is None:
        raise ValueError(f"checkpoint KV-cache scale {original!r} does not match any attention layer")
    if tensor.numel() != 1:
        raise ValueError(f"checkpoint KV-cache scale {original!r} has shape {tuple(tensor.shape)}: only one "
                         "scale per layer (per-tensor) is implemented")
    value = float(tensor.float().reshape(()))
    if not math.isfinite(value) or value <= 0.0:
        raise ValueError(f"checkpoint KV-cache scale {original!r} is {value}; it must be a finite number > 0")
    if "k" in which:
        layer.k_scale = value
    if "v" in which:
        layer.v_scale = value
    layer.kv_scales_source = "checkpoint"
    return True


def apply_kv_scales(model: nn.Module, cache_dtype: torch.dtype, file_scales: tuple[float, ...] | None,
                    calculate: bool, what: str = "the model") -> None:
    """After loading: settle every attention layer's scales for a cache of `cache_dtype`. `file_scales`:
    this rank's per-layer scales from --quantization-param-path; `calculate`: --calculate-kv-scales (the
    runner computes them on its first step). Warns when an fp8 cache runs with every scale at 1.0."""
    layers = [m for m in model.modules() if isinstance(m, Attention)]
    if not layers:
        return
    from_checkpoint = [layer for layer in layers if layer.kv_scales_source == "checkpoint"]
    if cache_dtype.itemsize != 1:  # not an fp8 cache: scales do not apply
        if from_checkpoint:
            logger.info("%s carries fp8 KV-cache scales for %d layers; they are not used with a %s KV cache "
                        "(pass --kv-cache-dtype fp8 to use them)", what, len(from_checkpoint), cache_dtype)
        for layer in layers:
            layer.k_scale = layer.v_scale = 1.0
            layer.kv_scales_source = None
        return
    if file_scales is not None:
        if len(file_scales) != len(layers):
            raise ValueError(f"--quantization-param-path: {len(file_scales)} layer scales for {len(layers)} "
                             "attention layers")
        if from_checkpoint:
            logger.warning("--quantization-param-path: its scales replace the KV-cache scales %s carries",
                           what)
        for layer, value in zip(layers, file_scales, strict=True):
            layer.k_scale = layer.v_scale = float(value)
            layer.kv_scales_source = "file"
        logger.info("fp8 KV cache (%s): per-layer scales from --quantization-param-path", cache_dtype)
        return
    if calculate:
        if from_checkpoint:
            logger.warning("--calculate-kv-scales: the scales computed on the first step replace the KV-cache "
                           "scales %s carries", what)
        logger.info("fp8 KV cache (%s): per-layer scales computed from the first step (--calculate-kv-scales)",
                    cache_dtype)
        return
    if from_checkpoint:
        missing = len(layers) - len(from_checkpoint)
        logger.info("fp8 KV cache (%s): per-layer scales from the checkpoint%s", cache_dtype,
                    f" ({missing} of {len(layers)} layers carry none and use 1.0)" if missing else "")
        return
    logger.warning("--kv-cache-dtype fp8: %s runs an fp8 KV cache (%s) with every KV scale at 1.0 (no scales in "
                   "the checkpoint); accuracy may suffer, and K/V beyond the fp8 range (%g) are clipped. Pass "
                   "--quantization-param-path FILE (per-layer scales) or --calculate-kv-scales (computed from "
                   "the first batch)", what, cache_dtype, fp8_max(cache_dtype))


def arm_calculation(model: nn.Module) -> None:
    """Make every attention layer compute its scales on its next planned forward (--calculate-kv-scales)."""
    for module in model.modules():
        if isinstance(module, Attention):
            module.calculate_kv_scales = True


def layer_scales(model: nn.Module) -> list[tuple[float, float]]:
    """Every attention layer's (k_scale, v_scale), in module order."""
    return [(m.k_scale, m.v_scale) for m in model.modules() if isinstance(m, Attention)]


def set_layer_scales(model: nn.Module, scales: list[tuple[float, float]], source: str) -> None:
    """Set every attention layer's scales (in module order), e.g. computed ones again after a reload."""
    layers = [m for m in model.modules() if isinstance(m, Attention)]
    for layer, (k_scale, v_scale) in zip(layers, scales, strict=True):
        layer.k_scale, layer.v_scale, layer.kv_scales_source = k_scale, v_scale, source
