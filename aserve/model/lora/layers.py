"""LoRA on any `Linear`: `LoRALinearMethod` wraps the layer's own method (unquantized, CPU kernel, int4,
int8, gguf, gptq, fp8...) and adds the per-token LoRA delta of the current step.

`apply(layer, x, bias) = base.apply(layer, x, bias) + delta` for the tokens the forward context's
mapping (`aserve/model/forward_context.py`) gives a slot; with no mapping it is exactly the base
result at no extra cost. The delta is computed in the LoRA dtype and added in the base result's dtype
(so a `float_output` layer keeps its float32 result).

Methods are stateless; the LoRA tensors live on the layer as non-persistent buffers (`add_lora_to_layer`),
in the layout of `aserve/kernels/lora_ops.py`:
  lora_a     `[max_loras, max_rank * num_shards, input_size]` (rank-major across shards)
  lora_b     `[max_loras, output_size, max_rank]` (rows of shard i use shard i's B)
  lora_bias  `[max_loras, output_size]` with `enable_lora_bias`, else None
  lora_ranks host list, one rank per slot (0 = empty or not targeted by the slot's adapter)
  lora_cpu_kernel  on CPU with bf16 LoRA weights, the C kernel (`aserve/kernels/lora_cpu.py`) when it
                   builds, else None; when set, also
  lora_b_tiles  `[max_loras, ceil(output_size / 16), max_rank, 16]`, each slot's lora_b tiled (`tile_b`)
  lora_rank_array  int64 `[max_loras]`, lora_ranks as a tensor; lora_slice_array int64 `[num_shards]`
(else lora_b_tiles is None). CPU steps then take that kernel: one call per layer, each token multiplied
only by its own slot's weights.
Sizes are this rank's under tensor parallelism. `set_slot` takes checkpoint-sized (unsharded) weights
with scaling already folded in and keeps this rank's part: a COLUMN layer's B and bias rows (each
part's slice, `part_replicas` respected), a ROW layer's A input columns (B whole; the delta is added
before the layer's all-reduce, which sums the partial shrinks; the bias only on tp_rank 0).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from aserve.config import LoRAConfig
from aserve.kernels import lora_cpu
from aserve.kernels.lora_ops import lora_delta_cpu, lora_delta_dense, lora_expand, lora_shrink
from aserve.model.forward_context import get_forward_context
from aserve.model.layers.linear import COLUMN, ROW, Linear, MergedLinear
from aserve.model.lora.mapping import LoRABatchMapping
from aserve.model.quantization.base import LinearMethodBase

LORA_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
# Without the C kernel (`lora_cpu_kernel` None: float32 / float16 LoRA weights, no compiler) or under
# torch.compile, CPU steps of at most this many tokens take the dense path (one shrink over every slot,
# a mask, one expand: few ops per layer); longer ones the grouped path (no work on other slots' columns).
DENSE_MAX_TOKENS = 128
# The dense path keeps B block-diagonally per slot (`lora_b_dense`), sized output x slots x rank x
# shards; above this many slot-rank columns per shard it is not kept and CPU steps are grouped.
DENSE_MAX_COLUMNS = 256


@dataclass(frozen=True)
class LoRAShardWeights:
    """One shard's adapter weights at checkpoint (unsharded) size, scaling folded into B and bias:
    `lora_a [r, input_size]`, `lora_b [shard output rows, r]`, `lora_bias [shard output rows]`."""

    lora_a: torch.Tensor
    lora_b: torch.Tensor
    lora_bias: torch.Tensor | None = None

    @property
    def rank(self) -> int:
        return int(self.lora_a.shape[0])


class LoRALinearMethod(LinearMethodBase):
    """`base`'s result plus the current step's LoRA delta (see the module docstring)."""

    def __init__(self, base: LinearMethodBase):
        self.base = base
        self.name = f"{base.name}+lora"

    def create_weights(self, layer: Linear, device: torch.device | str | None = None) -> None:
        self.base.create_weights(layer, device)

    def process_weights_after_loading(self, layer: Linear) -> None:
        self.base.process_weights_after_loading(layer)

    def apply(self, layer: Linear, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        y = self.base.apply(layer, x, bias)
        mapping = get_forward_context().lora
        if mapping is None:
            return y
        return add_lora_delta(layer, x, y, mapping)


def add_lora_delta(layer: Linear, x: torch.Tensor, y: torch.Tensor, mapping: LoRABatchMapping) -> torch.Tensor:
    """`y` (the base result for `x [..., input_size]`) plus the layer's LoRA delta for `mapping`'s tokens,
    in y's dtype (y is updated in place where its layout allows). ValueError when x's token count is
    not the mapping's."""
    x2 = x.reshape(-1, x.shape[-1])
    if x2.shape[0] != mapping.num_tokens:
        raise ValueError(f"LoRA: the layer got {x2.shape[0]} tokens, the step's mapping has {mapping.num_tokens}")
    y2 = y.reshape(-1, y.shape[-1])
    if y2.stride(-1) != 1:
        y2 = y2.contiguous()
    lora_bias = layer.lora_bias if layer.lora_adds_bias else None
    kernel = layer.lora_cpu_kernel
    if kernel is not None and kernel.accepts(x2, y2, layer.lora_a):  # CPU, bf16: one C call
        kernel.lora_delta(x2, mapping.token_slots, layer.lora_a, layer.lora_rank_array, layer.lora_b_tiles,
                          layer.lora_slice_array, y2, lora_bias)
    elif x2.is_cuda:  # per-token kernels, no host data: capturable in a CUDA graph
        shrunk = lora_shrink(x2, layer.lora_a, mapping.token_slots)
        lora_expand(shrunk, layer.lora_b, mapping.token_slots, y2, layer.lora_output_slices, lora_bias)
    elif layer.lora_b_dense is not None and mapping.num_tokens <= DENSE_MAX_TOKENS:
        slots, width = layer.lora_a.shape[0], layer.lora_a.shape[1]
        column_mask, slot_mask = mapping.masks(slots, width, layer.lora_a.dtype)
        lora_delta_dense(x2, column_mask, layer.lora_a, layer.lora_b_dense, y2, slot_mask, lora_bias)
    else:
        lora_delta_cpu(x2, mapping, layer.lora_a, layer.lora_b, layer.lora_ranks, layer.lora_output_slices,
                       lora_bias, y=y2)
    return y2.view(y.shape)


def output_slices(layer: Linear) -> tuple[int, ...]:
    """This rank's output rows of each shard (one shard for an unfused layer)."""
    return tuple(layer.output_sizes) if isinstance(layer, MergedLinear) else (layer.output_size,)


def full_input_size(layer: Linear) -> int:
    """The checkpoint's input size (a ROW layer holds `1 / tp_size` of it)."""
    ctx = layer.parallel
    return layer.input_size * ctx.tp_size if ctx is not None and layer.parallel_form == ROW else layer.input_size


def full_output_sizes(layer: Linear) -> list[int]:
    """The checkpoint's output rows of each shard (a COLUMN layer holds this rank's slice of each)."""
    ctx = layer.parallel
    local = output_slices(layer)
    if ctx is None or layer.parallel_form != COLUMN:
        return list(local)
    replicas = getattr(layer, "part_replicas", (1,) * len(local))
    return [size * ctx.tp_size // r for size, r in zip(local, replicas, strict=True)]


def add_lora_to_layer(layer: Linear, lora_config: LoRAConfig, device: torch.device | str) -> None:
    """Wrap `layer`'s method in `LoRALinearMethod` and allocate its empty slot buffers (zeros) on
    `device`. Call after `process_weights_after_loading` (and after any tensor-parallel form is set).
    ValueError if the layer is already wrapped or the LoRA dtype is unknown."""
    if isinstance(layer.quant_method, LoRALinearMethod):
        raise ValueError(f"{layer!r} already takes LoRA")  # noqa: TRY004 - a state error, not a type error
    try:
        dtype = LORA_DTYPES[lora_config.lora_dtype]
    except KeyError:
        raise ValueError(f"lora_dtype: expected one of {sorted(LORA_DTYPES)}, got {lora_config.lora_dtype!r}") from None
    slices = output_slices(layer)
    slots, rank = lora_config.max_loras, lora_config.max_lora_rank
    layer.register_buffer("lora_a", torch.zeros(slots, rank * len(slices), layer.input_size, dtype=dtype,
                                                device=device), persistent=False)
    layer.register_buffer("lora_b", torch.zeros(slots, layer.output_size, rank, dtype=dtype, device=device),
                          persistent=False)
    bias = torch.zeros(slots, layer.output_size, dtype=dtype, device=device) if lora_config.enable_lora_bias else None
    layer.register_buffer("lora_bias", bias, persistent=False)
    dense = None
    if torch.device(device).type == "cpu" and slots * rank <= DENSE_MAX_COLUMNS:
        dense = torch.zeros(layer.output_size, slots * rank * len(slices), dtype=dtype, device=device)
    layer.register_buffer("lora_b_dense", dense, persistent=False)
    on_cpu_bf16 = torch.device(device).type == "cpu" and dtype == torch.bfloat16
    kernel = lora_cpu.load() if on_cpu_bf16 else None
    layer.lora_cpu_kernel = kernel
    tiles = None
    if kernel is not None:
        tiles = torch.zeros(slots, -(-layer.output_size // 16), rank, 16, dtype=dtype, device=device)
    layer.register_buffer("lora_b_tiles", tiles, persistent=False)
    layer.lora_rank_array = torch.zeros(slots, dtype=torch.int64)
    layer.lora_slice_array = lora_cpu.slice_array(slices)
    layer.lora_ranks = [0] * slots
    layer.lora_output_slices = slices
    ctx = layer.parallel
    # a ROW layer's partial outputs are summed across ranks: the bias is added once, on rank 0
    layer.lora_adds_bias = bias is not None and not (ctx is not None and layer.parallel_form == ROW and ctx.tp_rank != 0)
    layer.quant_method = LoRALinearMethod(layer.quant_method)


def clear_slot(layer: Linear, slot: int) -> None:
    """Empty `slot` of a LoRA-wrapped layer (zero weights, rank 0)."""
    layer.lora_a[slot].zero_()
    layer.lora_b[slot].zero_()
    if layer.lora_b_dense is not None:
        _dense_view(layer)[:, slot].zero_()
    if layer.lora_b_tiles is not None:
        layer.lora_b_tiles[slot].zero_()
    if layer.lora_bias is not None:
        layer.lora_bias[slot].zero_()
    layer.lora_ranks[slot] = 0
    layer.lora_rank_array[slot] = 0


def set_slot(layer: Linear, slot: int, shard_weights: Sequence[LoRAShardWeights | None]) -> None:
    """Put one adapter's weights for this layer into `slot`: one entry per shard (None: the adapter
    does not target that shard, which stays zero), checkpoint-sized (see the module docstring).
    ValueError on a wrong shard count, a rank above the layer's max rank, a shape that does not fit,
    or a bias given to a layer without LoRA bias buffers."""
    slices = layer.lora_output_slices
    if len(shard_weights) != len(slices):
        raise ValueError(f"expected weights for {len(slices)} shard(s), got {len(shard_weights)}")
    clear_slot(layer, slot)
    max_rank = layer.lora_b.shape[2]
    a_view = layer.lora_a[slot].view(max_rank, len(slices), layer.input_size)
    replicas = getattr(layer, "part_replicas", (1,) * len(slices))
    offset, rank = 0, 0
    for shard, (weights, size) in enumerate(zip(shard_weights, slices, strict=True)):
        if weights is not None:
            r = weights.rank
            if r > max_rank:
                raise ValueError(f"shard {shard}: rank {r} exceeds max_lora_rank {max_rank}")
            column = layer.parallel is not None and layer.parallel_form == COLUMN
            a = layer._rank_slice(weights.lora_a) if layer.parallel_form == ROW else weights.lora_a
            b = layer._rank_slice(weights.lora_b, replicas[shard]) if column else weights.lora_b
            if tuple(a.shape) != (r, layer.input_size) or tuple(b.shape) != (size, r):
                raise ValueError(f"shard {shard}: lora_a {tuple(a.shape)} / lora_b {tuple(b.shape)} do not fit "
                                 f"[{r}, {layer.input_size}] / [{size}, {r}]")
            a_view[:r, shard].copy_(a)
            layer.lora_b[slot, offset:offset + size, :r].copy_(b)
            if weights.lora_bias is not None:
                if layer.lora_bias is None:
                    raise ValueError("the adapter has a LoRA bias but the layer has none (enable_lora_bias)")
                bias = layer._rank_slice(weights.lora_bias, replicas[shard]) if column else weights.lora_bias
                if tuple(bias.shape) != (size,):
                    raise ValueError(f"shard {shard}: lora_bias {tuple(bias.shape)} does not fit [{size}]")
                layer.lora_bias[slot, offset:offset + size].copy_(bias)
            rank = max(rank, r)
        offset += size
    layer.lora_ranks[slot] = rank
    layer.lora_rank_array[slot] = rank
    if layer.lora_b_tiles is not None:
        layer.lora_b_tiles[slot].copy_(lora_cpu.tile_b(layer.lora_b[slot]))
    if layer.lora_b_dense is not None:  # shard i's B rows in slot's rank columns of shard i
        dense = _dense_view(layer)
        offset = 0
        for shard, size in enumerate(slices):
            dense[offset:offset + size, slot, :, shard].copy_(layer.lora_b[slot, offset:offset + size])
            offset += size


def _dense_view(layer: Linear) -> torch.Tensor:
    """`lora_b_dense` as `[output, slots, max_rank, shards]` (the column order of lora_a's rows)."""
    slots, max_rank = layer.lora_b.shape[0], layer.lora_b.shape[2]
    return layer.lora_b_dense.view(layer.output_size, slots, max_rank, len(layer.lora_output_slices))
