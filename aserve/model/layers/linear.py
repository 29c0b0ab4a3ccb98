"""Dense linear layers. Fused projections (qkv, gate/up) are one `MergedLinear` whose shards are
filled by the weight loader, so model code only composes layers.

How a layer stores and applies its weight is its quantization method (`quant_method`, a
`LinearMethodBase` from `aserve.model.quantization`): the float `UnquantizedLinearMethod` unless the
loader sets another with `set_quant_method` before loading weights.

Tensor parallelism is a layer form the loader chooses too (`set_tensor_parallel`, from the model's
declared `column_parallel_modules` / `row_parallel_modules`; `aserve/model/tensor_parallel.py`): the
layer is built at this rank's size (the model reads per-rank sizes from `ArchConfig`) and `load_shard`
narrows each checkpoint tensor to this rank's slice. Column-parallel: output rows split (a merged
layer splits each part; q|k|v by heads, with k and v replicated on `part_replicas` ranks when there
are fewer KV heads than ranks). Row-parallel: input columns split, the partial outputs all-reduced,
the bias added once (on rank 0, before the sum). Quantization methods see a plain weight of the local
shape. With one rank no layer is touched and nothing changes.
"""

from __future__ import annotations

import torch
from torch import nn

from aserve.distributed.collectives import all_reduce
from aserve.distributed.context import ParallelContext, shard_along
from aserve.model.quantization.base import LinearMethodBase, drop_weights
from aserve.model.quantization.unquantized import UnquantizedLinearMethod

_UNQUANTIZED = UnquantizedLinearMethod()  # stateless: shared by every layer
COLUMN, ROW = "column", "row"  # tensor-parallel forms (a layer without one is replicated)


class Linear(nn.Module):
    """`y = x @ W.T (+ bias)` for `W [output_size, input_size]` (Hugging Face layout), held and applied
    by `quant_method`. `params_dtype` is the model's dtype (activations, bias, float weights)."""

    def __init__(self, input_size: int, output_size: int, bias: bool = False, dtype: torch.dtype | None = None):
        super().__init__()
        self.input_size = input_size
        self.output_size = output_size
        self.params_dtype = dtype or torch.get_default_dtype()
        self.bias = nn.Parameter(torch.empty(output_size, dtype=dtype), requires_grad=False) if bias else None
        self.quant_method: LinearMethodBase = _UNQUANTIZED
        self.quant_method.create_weights(self)
        # Set by the loader where this layer's output only feeds ops that take float32 rows (the model's
        # `float_output_modules`, on CPU with aserve's C kernels): a method may then return its unrounded
        # float32 product instead of x's dtype.
        self.float_output = False
        # Set by the loader with more than one rank (`set_tensor_parallel`): None (replicated) | COLUMN | ROW.
        self.parallel: ParallelContext | None = None
        self.parallel_form: str | None = None

    def set_tensor_parallel(self, ctx: ParallelContext, form: str) -> None:
        """Serve this layer as `form` (COLUMN | ROW) of `ctx`'s group; call before loading weights. The
        layer already has this rank's sizes."""
        if form not in (COLUMN, ROW):
            raise ValueError(f"unknown tensor-parallel form {form!r}")
        self.parallel, self.parallel_form = ctx, form

    def _rank_slice(self, loaded: torch.Tensor, replicas: int = 1) -> torch.Tensor:
        """This rank's slice of a checkpoint tensor (`[output, input]` or a bias `[output]`)."""
        if self.parallel is None:
            return loaded
        if self.parallel_form == COLUMN:
            return shard_along(loaded, 0, self.parallel, replicas)
        return shard_along(loaded, 1, self.parallel) if loaded.dim() >= 2 else loaded  # ROW: bias whole

    def set_quant_method(self, method: LinearMethodBase) -> None:
        """Replace the quantization method before weights are loaded: the current method's (unloaded)
        weights are dropped and `method.create_weights` registers its own, on the bias' device."""
        device = self.bias.device if self.bias is not None else next(self.parameters()).device
        drop_weights(self)
        self.quant_method = method
        method.create_weights(self, device)

    def process_weights_after_loading(self) -> None:
        """Called once by the loader after every weight is loaded (see LinearMethodBase)."""
        self.quant_method.process_weights_after_loading(self)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        ctx = self.parallel
        if ctx is None or self.parallel_form != ROW:
            return self.quant_method.apply(self, x, self.bias)
        partial = self.quant_method.apply(self, x, self.bias if ctx.tp_rank == 0 else None)
        return all_reduce(partial, ctx)

    def load_shard(self, param: torch.Tensor, loaded: torch.Tensor, shard_id: int | None = None) -> None:
        """Copy a checkpoint tensor (this rank's slice of it under tensor parallelism) into `param`
        (`shard_id` must be None for an unfused layer)."""
        if shard_id is not None:
            raise ValueError(f"{type(self).__name__} is not fused; got shard {shard_id}")
        _copy_checked(param.data, self._rank_slice(loaded))

    def extra_repr(self) -> str:
        form = f", tp={self.parallel_form}" if self.parallel is not None else ""
        return (f"in={self.input_size}, out={self.output_size}, bias={self.bias is not None}, "
                f"method={self.quant_method.name}{form}")


class MergedLinear(Linear):
    """Several projections of the same input stacked along the output dim (e.g. q|k|v, gate|up).

    Shard `i` owns output rows `[offsets[i], offsets[i] + output_sizes[i])`.
    """

    def __init__(self, input_size: int, output_sizes: list[int], bias: bool = False,
                 dtype: torch.dtype | None = None):
        super().__init__(input_size, sum(output_sizes), bias, dtype)
        self.output_sizes = list(output_sizes)
        self.offsets = [sum(output_sizes[:i]) for i in range(len(output_sizes))]
        self.part_replicas = (1,) * len(output_sizes)  # ranks sharing each part's slice (column-parallel)

    def set_tensor_parallel(self, ctx: ParallelContext, form: str,
                            part_replicas: tuple[int, ...] | None = None) -> None:
        """Column-parallel only: each part is split across the ranks on its own; `part_replicas[i]`
        consecutive ranks share part i's slice (k and v when there are fewer KV heads than ranks)."""
        if form != COLUMN:
            raise ValueError(f"a merged layer is column-parallel only, not {form!r}")
        super().set_tensor_parallel(ctx, form)
        self.part_replicas = tuple(part_replicas or (1,) * len(self.output_sizes))

    def load_shard(self, param: torch.Tensor, loaded: torch.Tensor, shard_id: int | None = None) -> None:
        """Copy shard `shard_id` into its rows of `param` (dim 0; every method keeps the output dim
        first), or a whole already-fused tensor when `shard_id` is None (under tensor parallelism
        split into its parts by their full sizes, each narrowed to this rank's slice)."""
        if shard_id is None:  # an already-fused checkpoint tensor
            ctx = self.parallel
            if ctx is not None:
                full = [size * ctx.tp_size // r for size, r in zip(self.output_sizes, self.part_replicas)]
                if loaded.shape[0] != sum(full):
                    raise ValueError(f"checkpoint tensor has {loaded.shape[0]} rows, expected {sum(full)} "
                                     f"(parts {full} across {ctx.tp_size} ranks)")
                loaded = torch.cat([self._rank_slice(part, r) for part, r in
                                    zip(loaded.split(full, dim=0), self.part_replicas)])
            _copy_checked(param.data, loaded)
            return
        size = self.output_sizes[shard_id]
        _copy_checked(param.data.narrow(0, self.offsets[shard_id], size),
                      self._rank_slice(loaded, self.part_replicas[shard_id]))

    def split(self, y: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """Split an output `[..., sum(output_sizes)]` into the per-shard outputs (views)."""
        return y.split(self.output_sizes, dim=-1)


class Conv1DLinear(Linear):
    """A `Linear` whose checkpoint stores the weight `[input_size, output_size]` (transformers'
    `Conv1D`, GPT-2): 2-D checkpoint tensors are transposed as they load, so every method sees the
    usual `[output_size, input_size]`."""

    def load_shard(self, param: torch.Tensor, loaded: torch.Tensor, shard_id: int | None = None) -> None:
        super().load_shard(param, loaded.t() if loaded.dim() == 2 else loaded, shard_id)


class MergedConv1DLinear(MergedLinear):
    """A `MergedLinear` (e.g. GPT-2's fused q|k|v `c_attn`) whose checkpoint stores the weight
    `[input_size, sum(output_sizes)]`, transposed as it loads (see `Conv1DLinear`)."""

    def load_shard(self, param: torch.Tensor, loaded: torch.Tensor, shard_id: int | None = None) -> None:
        super().load_shard(param, loaded.t() if loaded.dim() == 2 else loaded, shard_id)


def _copy_checked(dst: torch.Tensor, src: torch.Tensor) -> None:
    if tuple(dst.shape) != tuple(src.shape):
        raise ValueError(f"checkpoint tensor has shape {tuple(src.shape)}, expected {tuple(dst.shape)}")
    dst.copy_(src)
