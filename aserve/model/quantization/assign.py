"""Giving a model's `Linear` layers their quantization methods, from outside the model (the loader
calls these; model files only compose layers).

A fused layer (`qkv_proj`) is fed by several checkpoint tensors (`q_proj`, `k_proj`, `v_proj`),
named by the model's `packed_modules_mapping`; it can be served natively from a GGUF file only when
every one of them is a 4-bit GGUF type.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Iterator

import torch
from torch import nn

from aserve.kernels import cpu_ops
from aserve.model.layers.linear import Linear
from aserve.model.layers.moe import FusedMoE
from aserve.model.quantization.base import LinearMethodBase
from aserve.model.quantization.cpu_kernel import CpuKernelLinearMethod
from aserve.model.quantization.cpu_packed import CpuPackedLinearMethod, cpu_packing_supported
from aserve.model.quantization.gguf import GGUF_INT4_SUFFIXES, GGUFInt4Method
from aserve.model.quantization.gguf_reader import GGUF_GROUP_SIZE, NATIVE_INT4_TYPES, GGUFLinearWeights
from aserve.model.quantization.int4 import Int4WeightOnlyMethod
from aserve.model.quantization.int4_cpu import dequantize_int4, int4_packable
from aserve.model.quantization.unquantized import UnquantizedLinearMethod

logger = logging.getLogger(__name__)


def linear_layers(model: nn.Module) -> list[tuple[str, Linear]]:
    """Every `Linear` (fused ones included) of `model`, with its module name."""
    return [(name, m) for name, m in model.named_modules() if isinstance(m, Linear)]


def expert_layers(model: nn.Module) -> list[tuple[str, FusedMoE]]:
    """Every MoE experts layer of `model` (its experts' projections take Linear methods too)."""
    return [(name, m) for name, m in model.named_modules() if isinstance(m, FusedMoE)]


def checkpoint_prefixes(model: nn.Module, name: str) -> list[str]:
    """The checkpoint module names that feed layer `name`, in shard order (just `name` if unfused)."""
    parent, _, short = name.rpartition(".")
    mapping: dict[str, tuple[str, int]] = getattr(model, "packed_modules_mapping", {})
    shards = sorted((shard, ckpt) for ckpt, (fused, shard) in mapping.items() if fused == short)
    return [f"{parent}.{ckpt}" for _, ckpt in shards] or [name]


def set_checkpoint_method(model: nn.Module, method: LinearMethodBase, prefixes: set[str],
                          what: str) -> dict[str, tuple[Linear, int | None]]:
    """Give `method` to every Linear whose checkpoint modules (`checkpoint_prefixes`) are all in
    `prefixes` (the checkpoint's quantized modules); returns {checkpoint prefix: (layer, shard id or
    None when unfused)}. ValueError, naming `what` (e.g. "gptq checkpoint"), for a fused layer fed by
    quantized and float tensors, or a quantized module that is not a Linear (MoE experts)."""
    targets: dict[str, tuple[Linear, int | None]] = {}
    for name, layer in linear_layers(model):
        feeds = checkpoint_prefixes(model, name)
        quantized = [p for p in feeds if p in prefixes]
        if not quantized:
            continue
        if len(quantized) != len(feeds):
            raise ValueError(f"{what}: {name} fuses {feeds}, of which only {quantized} are quantized; "
                             "mixed fused layers are not implemented")
        layer.set_quant_method(method)
        fused = len(feeds) > 1 or feeds != [name]
        for shard, prefix in enumerate(feeds):
            targets[prefix] = (layer, shard if fused else None)
    unknown = sorted(prefixes - targets.keys())
    if unknown:
        raise ValueError(f"{what}: quantized modules {unknown[:4]} are not Linear layers aserve quantizes "
                         "(quantized MoE experts are not implemented)")
    return targets


def set_load_time_method(model: nn.Module, method: LinearMethodBase) -> int:
    """Give `method` (int4 / int8, quantizing at load) to every layer whose shape it takes; returns
    how many layers took it (the others keep their float weight)."""
    count = 0
    for _, layer in linear_layers(model):
        if isinstance(method, Int4WeightOnlyMethod) and not int4_packable(layer.output_size, layer.input_size,
                                                                           method.group_size):
            continue
        layer.set_quant_method(method)
        count += 1
    experts = expert_layers(model)
    taken = [moe for _, moe in experts if not isinstance(method, Int4WeightOnlyMethod) or (
        int4_packable(2 * moe.intermediate_size, moe.hidden_size, method.group_size)
        and int4_packable(moe.hidden_size, moe.intermediate_size, method.group_size))]
    for moe in taken:
        moe.set_quant_method(method)
    if experts:
        logger.info("%s: %d of %d MoE expert layers quantized at load (every expert's projections)",
                    method.name, len(taken), len(experts))
    return count


def set_gguf_methods(model: nn.Module, gguf: GGUFLinearWeights) -> set[str]:
    """Give the GGUF int4 method to every layer whose checkpoint tensors are all Q4_0/Q4_1 in `gguf`
    (and whose shape the kernel takes); returns their checkpoint prefixes. The rest stay float."""
    method = GGUFInt4Method()
    native: set[str] = set()
    for name, layer in linear_layers(model):
        prefixes = checkpoint_prefixes(model, name)
        if all(gguf.quant_type(p) in NATIVE_INT4_TYPES for p in prefixes) and int4_packable(
                layer.output_size, layer.input_size, GGUF_GROUP_SIZE):
            layer.set_quant_method(method)
            native.update(prefixes)
    if expert_layers(model):
        logger.warning("--quantization gguf: MoE experts are served from the dequantized float copy "
                       "(the GGUF int4 method covers Linear layers only)")
    return native


def gguf_weights(float_weights: Iterable[tuple[str, torch.Tensor]], gguf: GGUFLinearWeights,
                 native: set[str]) -> Iterator[tuple[str, torch.Tensor]]:
    """`float_weights` (which must leave out the `native` layers' float weights), then those layers'
    4-bit components (`<prefix>.qweight`, `.scales`, `.zeros`) from the GGUF file."""
    yield from float_weights
    for prefix in sorted(native):
        for suffix, part in zip(GGUF_INT4_SUFFIXES, gguf.int4_components(prefix), strict=True):
            yield f"{prefix}.{suffix}", part


def check_gguf_decoding(gguf: GGUFLinearWeights, prefix: str, reference: torch.Tensor) -> None:
    """Raise ValueError unless `prefix`'s 4-bit components dequantize to `reference` (the float
    checkpoint converted from the same file), which catches a wrong row order or block layout."""
    got = dequantize_int4(*gguf.int4_components(prefix), GGUF_GROUP_SIZE)
    if got.shape != reference.shape or not torch.allclose(got, reference.float(), rtol=1e-5, atol=1e-6):
        raise ValueError(f"--quantization gguf: {prefix} decoded from {gguf.path} does not match its dequantized "
                         "copy (unsupported layout); drop --quantization to serve it dequantized")


def use_cpu_linear_forms(model: nn.Module) -> int:
    """After loading, for bf16 models on CPU: the float Linear layers and the LM head multiply in aserve's
    C kernel where it has packed products (`cpu_kernel.py`: AVX512-BF16 dot products, or fp32 FMAs on
    AVX2; every Linear named in the model's `float_output_modules` gets `float_output`, which the
    C-kernel methods honour), else by oneDNN-packed weights where oneDNN has bf16 kernels
    (`cpu_packed.py`); nothing changes otherwise. Returns how many Linear layers switched."""
    dtype = getattr(model, "dtype", None)
    head = getattr(model, "lm_head", None)
    device = head.weight.device if head is not None else next(model.parameters()).device
    if dtype != torch.bfloat16 or torch.device(device).type != "cpu":
        return 0
    kernels = cpu_ops.load()
    if kernels is not None and not kernels.packed_matmuls:
        kernels = None
    if kernels is None and not cpu_packing_supported(dtype, device):
        return 0
    float_outputs = set(getattr(model, "float_output_modules", ()))
    method: LinearMethodBase = CpuKernelLinearMethod(kernels) if kernels is not None else CpuPackedLinearMethod()
    count = 0
    for name, layer in linear_layers(model):
        # The consumers' float32 forms are the C kernels: only with them (any method may use it).
        layer.float_output = kernels is not None and name.rsplit(".", 1)[-1] in float_outputs
        if type(layer.quant_method) is UnquantizedLinearMethod:
            layer.quant_method = method
            count += 1
    for _, moe in expert_layers(model):  # their output feeds only the residual add and RMSNorm
        moe.float_output = kernels is not None
        if type(moe.quant_method) is UnquantizedLinearMethod:
            moe.quant_method = method
    if head is not None:
        if kernels is not None:
            head.use_cpu_kernel(kernels)
        else:
            head.pack_for_cpu()
    return count


def process_weights_after_loading(model: nn.Module) -> dict[str, int]:
    """Run every Linear's and MoE experts layer's `process_weights_after_loading`; returns the number of
    layers per method (experts layers as `<method> (experts)`)."""
    counts: dict[str, int] = {}
    for _, layer in linear_layers(model):
        layer.process_weights_after_loading()
        counts[layer.quant_method.name] = counts.get(layer.quant_method.name, 0) + 1
    for _, moe in expert_layers(model):
        moe.process_weights_after_loading()
        key = f"{moe.quant_method.name} (experts)"
        counts[key] = counts.get(key, 0) + 1
    return counts
