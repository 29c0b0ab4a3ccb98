"""The weights of quantized checkpoints and GGUF files, for the loader (`load_model`): each format's
reader sets its Linear method on the layers the file quantizes and yields the tensors to load in the
method's form. A checkpoint's `QuantSpec.method` picks the reader (fp8, bitsandbytes, w8a8, or
gptq / awq / compressed-tensors pack-quantized); `--quantization gguf` reads the 4-bit blocks of the
GGUF file the folder was converted from."""

from __future__ import annotations

import functools
import logging
import os
from collections.abc import Iterator

import torch
from torch import nn

from aserve.config import AserveConfig
from aserve.model.loader import WeightsNotFoundError, iterate_weights, weight_files
from aserve.model.quantization import assign
from aserve.model.quantization.gguf_reader import GGUFLinearWeights

logger = logging.getLogger(__name__)


def quantized_weights(model: nn.Module, config: AserveConfig, threads: int = 1) -> Iterator[tuple[str, torch.Tensor]]:
    """The tensors to load for `--quantization gguf` or a quantized checkpoint (`config.load.quant_spec`),
    after setting the format's methods on `model`'s layers; ValueError when the file does not fit."""
    path, load_format, spec = config.model.model_path, config.load.load_format, config.load.quant_spec
    if config.load.quantization == "gguf":
        return _gguf_weights(model, path)
    readers = {"fp8": _fp8_checkpoint_weights, "bitsandbytes": _bnb_checkpoint_weights,
               "w8a8": _w8a8_checkpoint_weights}  # else a GPTQ / AWQ / compressed-tensors pack-quantized one
    return readers.get(spec.method, _checkpoint_quantized_weights)(model, spec, path, load_format, threads)


def _open_gguf(source: str) -> GGUFLinearWeights:
    """The file's reader, shared by the weights and the LM head of one load (its index takes ~0.1 s to read)."""
    stat = os.stat(source)
    return _open_gguf_version(source, stat.st_mtime_ns, stat.st_size)


@functools.lru_cache(maxsize=1)
def _open_gguf_version(source: str, mtime_ns: int, size: int) -> GGUFLinearWeights:
    return GGUFLinearWeights(source)


def _gguf_weights(model: nn.Module, model_path: str) -> Iterator[tuple[str, torch.Tensor]]:
    """Set the GGUF int4 method where the file allows it; the checkpoint tensors to load."""
    from aserve.model_source import gguf_source_of

    source = gguf_source_of(model_path)
    if source is None:
        raise ValueError(f"--quantization gguf: {model_path} was not converted from a .gguf file; "
                         "pass a .gguf file (or no --model for the bundled one) or drop --quantization")
    gguf = _open_gguf(source)
    native = assign.set_gguf_methods(model, gguf)
    logger.info("--quantization gguf: %d of %d GGUF Linear weights served in 4 bits from %s", len(native),
                len(gguf.names()), source)
    if native:  # one layer checked against the converted copy: catches an unknown layout loudly
        first = min(native)
        _, files = weight_files(model_path, "safetensors")
        assign.check_gguf_decoding(gguf, first, _read_tensor(files, f"{first}.weight"))
    floats = iterate_weights(model_path, "safetensors", skip=lambda name: name.rsplit(".", 1)[0] in native)
    return assign.gguf_weights(floats, gguf, native)


def use_gguf_q8_head(model: nn.Module, model_path: str) -> bool:
    """After loading with `--quantization gguf`, bf16 on CPU: the LM head multiplies by the file's own
    Q8_0 codes (`LMHead.use_q8_weight`) when the file keeps its output projection so and they match
    the loaded float head (checked on a slice of rows). Returns whether the head switched."""
    from aserve.kernels import cpu_ops
    from aserve.model_source import gguf_source_of

    head, source = getattr(model, "lm_head", None), gguf_source_of(model_path)
    if head is None or source is None or head.weight.dtype != torch.bfloat16 or head.weight.device.type != "cpu":
        return False
    kernels = cpu_ops.load()
    components = _open_gguf(source).head_q8_components() if kernels is not None else None
    if components is None:
        return False
    codes, scales = components
    rows = slice(0, min(256, codes.shape[0]))
    dequantized = (codes[rows].float().reshape(-1, scales.shape[1], 32) * scales[rows, :, None]).reshape(
        codes[rows].shape)
    if codes.shape != head.weight.shape or not torch.allclose(dequantized.bfloat16().float(),
                                                               head.weight.data[rows].float(), rtol=0, atol=1e-6):
        logger.warning("--quantization gguf: the file's Q8_0 output projection does not match the loaded LM head; "
                       "the head stays bf16")
        return False
    if not head.use_q8_weight(kernels, codes, scales):
        return False
    logger.info("--quantization gguf: LM head from the file's Q8_0 codes (%.1f MB; bf16 would stream %.1f MB a "
                "token), activations rounded to int16 per 32", codes.numel() * (1 + 4 / 32) / 1e6,
                codes.numel() * 2 / 1e6)
    return True


def _checkpoint_tensor_names(model_path: str, load_format: str, what: str) -> list[str]:
    """The tensor names of a quantized checkpoint's safetensors files; ValueError (naming `what`) for others."""
    kind, files = weight_files(model_path, load_format)
    if kind != "safetensors":
        raise ValueError(f"{what} are read from safetensors only")
    return _tensor_names(files)


def _checkpoint_quantized_weights(model: nn.Module, spec, model_path: str,
                                  load_format: str, threads: int = 1) -> Iterator[tuple[str, torch.Tensor]]:
    """Set the checkpoint method on the layers the checkpoint quantizes; the tensors to load, each
    quantized module's in the method's form (aserve/model/quantization/checkpoint_formats.py)."""
    from aserve.model.quantization import checkpoint_formats

    names = _checkpoint_tensor_names(model_path, load_format, f"--quantization {spec.method}: quantized checkpoints")
    targets = checkpoint_formats.assign_methods(model, spec, _not_ignored(
        spec, checkpoint_formats.quantized_prefixes(names, spec)))
    logger.info("--quantization %s: %d-bit, group size %d%s: %d of %d Linear layers quantized in the checkpoint",
                spec.method, spec.bits, spec.group_size, ", act-order" if spec.desc_act else "",
                len({id(layer) for layer, _ in targets.values()}), len(assign.linear_layers(model)))
    weights = iterate_weights(model_path, load_format, num_threads=threads)
    return checkpoint_formats.canonical_weights(weights, spec, targets)


def _fp8_checkpoint_weights(model: nn.Module, spec, model_path: str,
                           load_format: str, threads: int = 1) -> Iterator[tuple[str, torch.Tensor]]:
    """Set the fp8 checkpoint method on the layers the checkpoint stores in fp8; the tensors to load
    (aserve/model/quantization/fp8.py)."""
    from aserve.model.quantization import fp8

    names = _checkpoint_tensor_names(model_path, load_format, "--quantization fp8: fp8 checkpoints")
    prefixes = _not_ignored(spec, fp8.fp8_prefixes(names))
    targets = fp8.assign_fp8_methods(model, spec.block_size, prefixes)
    logger.info("--quantization fp8: %s scales, %s activations (served unquantized): %d of %d Linear layers fp8 "
                "in the checkpoint; kernel: %s",
                f"{list(spec.block_size)} block" if spec.block_size else "per-tensor / per-channel",
                spec.activation_scheme, len({id(layer) for layer, _ in targets.values()}),
                len(assign.linear_layers(model)), fp8.KERNEL)
    return fp8.fp8_weights(iterate_weights(model_path, load_format, num_threads=threads), spec.block_size, targets)


def _w8a8_checkpoint_weights(model: nn.Module, spec, model_path: str,
                             load_format: str, threads: int = 1) -> Iterator[tuple[str, torch.Tensor]]:
    """Set the W8A8 int8 method on the layers a compressed-tensors `int-quantized` checkpoint quantizes; the
    tensors to load (aserve/model/quantization/w8a8.py)."""
    from aserve.model.quantization import w8a8

    names = _checkpoint_tensor_names(model_path, load_format, "--quantization compressed-tensors: W8A8 checkpoints")
    static = spec.activation_scheme == "static"
    targets = w8a8.assign_w8a8_methods(model, static, _not_ignored(spec, w8a8.w8a8_prefixes(names)))
    logger.info("--quantization compressed-tensors: W8A8 int8, %s activations: %d of %d Linear layers int8 in the "
                "checkpoint; kernel: %s", "static per-tensor" if static else "dynamic per-token",
                len({id(layer) for layer, _ in targets.values()}), len(assign.linear_layers(model)), w8a8.KERNEL)
    return w8a8.w8a8_weights(iterate_weights(model_path, load_format, num_threads=threads), static, targets)


def _bnb_checkpoint_weights(model: nn.Module, spec, model_path: str,
                            load_format: str, threads: int = 1) -> Iterator[tuple[str, torch.Tensor]]:
    """Set the bitsandbytes checkpoint method on the layers the checkpoint quantizes; the tensors to load
    (aserve/model/quantization/bitsandbytes.py)."""
    from aserve.model.quantization import bitsandbytes as bnb

    names = _checkpoint_tensor_names(model_path, load_format, "--quantization bitsandbytes: bitsandbytes checkpoints")
    prefixes = bnb.quantized_prefixes(names, spec.bits)
    targets, dequantized = bnb.assign_checkpoint_methods(model, spec.bits, prefixes)
    logger.info("--quantization bitsandbytes: %s checkpoint: %d of %d Linear layers quantized%s",
                f"4-bit {spec.quant_type}" if spec.bits == 4 else "8-bit LLM.int8()",
                len({id(layer) for layer, _ in targets.values()}), len(assign.linear_layers(model)),
                "" if spec.bits == 4 else "; kernel: int8 weight-only (_weight_int8pack_mm), per-row SCB / 127")
    weights = iterate_weights(model_path, load_format, num_threads=threads)
    return bnb.checkpoint_weights(weights, spec.bits, targets, dequantized)


def _tensor_names(files: list[str]) -> list[str]:
    from safetensors import safe_open

    return [n for path in files for n in safe_open(path, framework="pt", device="cpu").keys()]  # noqa: SIM118


def _not_ignored(spec, prefixes: set[str]) -> set[str]:
    """`prefixes` (the checkpoint's quantized modules); ValueError naming any the config's ignore list
    names (`QuantSpec.ignores`): such a module must be stored in float, which is how it is left."""
    clash = sorted(p for p in prefixes if spec.ignores(p))
    if clash:
        raise ValueError(f"{spec.method} checkpoint: modules {clash[:4]} are named by the quantization_config's "
                         f"ignore list {list(spec.ignore)} but stored quantized")
    return prefixes


def _read_tensor(files: list[str], name: str) -> torch.Tensor:
    from safetensors import safe_open

    for path in files:
        with safe_open(path, framework="pt", device="cpu") as h:
            if name in h.keys():  # noqa: SIM118 (not a mapping)
                return h.get_tensor(name)
    raise WeightsNotFoundError(f"no tensor {name!r} in {files}")
