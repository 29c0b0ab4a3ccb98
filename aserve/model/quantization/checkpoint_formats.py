"""Reading GPTQ, AWQ and compressed-tensors `pack-quantized` Linear weights into the canonical form of
`checkpoint_int.CheckpointIntMethod` (codes `[N, K]` in group order, scales and zero points `[N, G]`).

On-disk layouts (int32 words hold `32 / bits` codes, the first in the lowest bits unless noted):
  GPTQ (AutoGPTQ / GPTQModel)  `qweight [K*bits/32, N]` packed along the input dim; `qzeros
      [G, N*bits/32]` packed along the output dim, the v1 format (`checkpoint_format` "gptq", and
      every AutoGPTQ checkpoint) storing `zero - 1`, v2 ("gptq_v2") the zero itself; `scales [G, N]`
      fp16; `g_idx [K]` the group of each input column (act-order when `desc_act`: the columns are
      sorted into group order here, and the layer permutes its input the same way).
  AWQ GEMM (AutoAWQ)  `qweight [K, N/8]` packed along the output dim in AWQ's interleaved order: word
      nibble i holds column `8j + (0, 2, 4, 6, 1, 3, 5, 7)[i]`; `qzeros [G, N/8]` the same; `scales [G, N]`.
  compressed-tensors pack-quantized  `weight_packed [N, K*bits/32]` packed along the input dim, codes
      stored as `q + 2**(bits-1)` of signed q; `weight_scale [N, G]`; `weight_zero_point` (asymmetric:
      `[N/(32/bits), G]` int32 packed along the output dim, or unpacked `[N, G]`); `weight_shape`.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator

import torch
from torch import nn

from aserve.config.quantization import QuantSpec
from aserve.model.layers.linear import Linear
from aserve.model.quantization.checkpoint_int import CheckpointIntMethod, num_groups

AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)  # word nibble i holds column AWQ_ORDER[i] of its 8
# The checkpoint tensors of one quantized Linear, per format (suffix after `<module>.`).
FORMAT_SUFFIXES = {"gptq": ("qweight", "qzeros", "scales", "g_idx"), "awq": ("qweight", "qzeros", "scales"),
                   "compressed-tensors": ("weight_packed", "weight_scale", "weight_zero_point", "weight_shape")}
_REQUIRED = {"gptq": ("qweight", "qzeros", "scales"), "awq": ("qweight", "qzeros", "scales"),
             "compressed-tensors": ("weight_packed", "weight_scale")}
_MARKER = {"gptq": "qweight", "awq": "qweight", "compressed-tensors": "weight_packed"}


def unpack(words: torch.Tensor, bits: int, dim: int, order: tuple[int, ...] | None = None) -> torch.Tensor:
    """int32 `words` -> uint8 codes, `32 / bits` per word along `dim` (word j's nibble i is element
    `j * per + i`, or `j * per + order[i]` with an interleaved `order`)."""
    per = 32 // bits
    shifts = torch.arange(per, dtype=torch.int32) * bits
    w = words.to(torch.int32).movedim(dim, -1)
    codes = (w.unsqueeze(-1) >> shifts) & ((1 << bits) - 1)  # [..., words, per] by nibble
    if order is not None:
        inverse = torch.tensor(order).argsort()  # element c of a word sits in nibble inverse[c]
        codes = codes[..., inverse]
    return codes.reshape(*w.shape[:-1], w.shape[-1] * per).to(torch.uint8).movedim(-1, dim)


def to_canonical(spec: QuantSpec, parts: dict[str, torch.Tensor], where: str
                 ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """(codes uint8 [N, K] in group order, scales fp32 [N, G], zeros fp32 [N, G], perm [K] or None)
    from one module's checkpoint tensors; ValueError when they do not fit the spec."""
    bits = spec.bits
    if spec.method == "gptq":
        codes = unpack(parts["qweight"], bits, 0).t()
        zeros = unpack(parts["qzeros"], bits, 1).t().float() + (1.0 if spec.gptq_v1_zeros else 0.0)
        scales = parts["scales"].float().t()
    elif spec.method == "awq":
        codes = unpack(parts["qweight"], bits, 1, AWQ_ORDER).t()
        zeros = unpack(parts["qzeros"], bits, 1, AWQ_ORDER).t().float()
        scales = parts["scales"].float().t()
    else:
        codes = unpack(parts["weight_packed"], bits, 1)
        scales = parts["weight_scale"].float()
        if scales.dim() == 1:
            scales = scales.unsqueeze(1)
        zp = parts.get("weight_zero_point")
        if spec.sym or zp is None:
            zeros = torch.zeros_like(scales)
        elif zp.dtype == torch.int32 and zp.shape[0] * (32 // bits) == codes.shape[0]:
            zeros = unpack(zp, bits, 0).float() - 2 ** (bits - 1)  # packed like the codes (offset)
        else:
            zeros = zp.float()
        zeros = zeros + 2 ** (bits - 1)  # the codes are stored offset by 2**(bits-1)
    n, k = codes.shape
    codes, scales, zeros = codes.contiguous(), scales.contiguous(), zeros.contiguous()
    groups = num_groups(k, spec.group_size)
    if scales.shape != (n, groups) or zeros.shape != (n, groups):
        raise ValueError(f"{where}: scales {tuple(scales.shape)} / zeros {tuple(zeros.shape)} do not fit a "
                         f"[{n}, {k}] weight with group_size {spec.group_size} ({groups} groups)")
    perm = None
    g_idx = parts.get("g_idx")
    if g_idx is not None:
        g_idx = g_idx.to(torch.int64)
        gs = k if spec.group_size == -1 else spec.group_size
        in_order = torch.arange(k) // gs
        if not torch.equal(g_idx, in_order):
            perm = torch.argsort(g_idx, stable=True)
            if not torch.equal(g_idx[perm], in_order):
                raise ValueError(f"{where}: g_idx does not form groups of {gs} columns; not implemented")
            codes = codes[:, perm].contiguous()
    return codes, scales, zeros, perm


def quantized_prefixes(names: Iterable[str], spec: QuantSpec) -> set[str]:
    """The module names holding quantized weights, from a checkpoint's tensor names."""
    marker = "." + _MARKER[spec.method]
    return {name[: -len(marker)] for name in names if name.endswith(marker)}


def assign_methods(model: nn.Module, spec: QuantSpec, prefixes: set[str]) -> dict[str, tuple[Linear, int | None]]:
    """Give every Linear whose checkpoint modules are all quantized the checkpoint method; returns
    {checkpoint prefix: (layer, shard id)}. ValueError for a fused layer fed by quantized and float
    tensors, or a quantized module that is not a Linear (MoE experts)."""
    from aserve.model.quantization.assign import set_checkpoint_method

    method = CheckpointIntMethod(spec.method, spec.bits, spec.group_size)
    return set_checkpoint_method(model, method, prefixes, f"{spec.method} checkpoint")


def canonical_weights(weights: Iterable[tuple[str, torch.Tensor]], spec: QuantSpec,
                      targets: dict[str, tuple[Linear, int | None]]) -> Iterator[tuple[str, torch.Tensor]]:
    """`weights` with each quantized module's tensors replaced by `<module>.qcodes / .qscales /
    .qzeros` (its act-order permutation is set on the layer here)."""
    suffixes = FORMAT_SUFFIXES[spec.method]
    pending: dict[str, dict[str, torch.Tensor]] = {}
    for name, tensor in weights:
        prefix, _, suffix = name.rpartition(".")
        if prefix not in targets or suffix not in suffixes:
            yield name, tensor
            continue
        if suffix == "weight_shape":  # metadata: the unpacked shape, which the layer already has
            continue
        parts = pending.setdefault(prefix, {})
        parts[suffix] = tensor
        if set(_REQUIRED[spec.method]) - set(parts):
            continue
        wanted = (spec.method == "gptq" and "g_idx" not in parts) or (
            spec.method == "compressed-tensors" and not spec.sym and "weight_zero_point" not in parts)
        if wanted:  # an optional part may still come
            continue
        yield from _emit(spec, prefix, pending.pop(prefix), targets)
    for prefix, parts in pending.items():  # modules whose optional parts never came
        missing = [s for s in _REQUIRED[spec.method] if s not in parts]
        if missing:
            raise ValueError(f"{spec.method} checkpoint: {prefix} lacks {missing}")
        yield from _emit(spec, prefix, parts, targets)


def _emit(spec: QuantSpec, prefix: str, parts: dict[str, torch.Tensor],
          targets: dict[str, tuple[Linear, int | None]]) -> Iterator[tuple[str, torch.Tensor]]:
    codes, scales, zeros, perm = to_canonical(spec, parts, prefix)
    layer, _ = targets[prefix]
    if perm is not None:
        CheckpointIntMethod.set_input_perm(layer, perm, prefix)
    elif getattr(layer, "input_perm", None) is not None:
        raise ValueError(f"{prefix}: its columns are in order while a projection fused with it has act-order")
    yield f"{prefix}.qcodes", codes
    yield f"{prefix}.qscales", scales
    yield f"{prefix}.qzeros", zeros
