"""Mixture-of-experts layers: top-k routing and the routed experts' SwiGLU MLPs.

`select_experts` turns router logits into each token's experts and weights (softmax in float32, top
k, renormalized to sum 1 where the family does). `FusedMoE` holds one layer's experts stacked,
`gate_up_proj [E, 2I, H]` (gate rows, then up) and `down_proj [E, H, I]`, filled from per-expert
checkpoint tensors through `load_expert_shard` (`CausalLM.load_weights` routes them there with the
model's `expert_params_mapping`) or from already-stacked ones through `load_shard`.

Forms (CustomOp): on CUDA the Triton grouped GEMM (`aserve.kernels.fused_moe`); elsewhere the pairs
are sorted by expert and each expert with pairs multiplies its rows once (`reference.grouped_moe`),
combined per token with `index_add_`. How each expert multiplies is a `LinearMethodBase`, as for
every `Linear`: the loader may give the layer a load-time quantization (int8, int4) or, for bf16 on
CPU, aserve's C-kernel / oneDNN-packed forms (`aserve.model.quantization.assign`); the layer then
applies the method to one `ExpertProjection` per expert and projection (views of the stacked weights
until the method re-lays them out) and drops the stacked copies. Under torch.compile (CPU -O3) the
grouped path is one opaque op (`aserve::moe_experts`): its expert loop depends on the routing.

Tensor parallelism (`set_tensor_parallel`, set by the loader): every rank holds every expert with its
intermediate dim split (the layer is built at this rank's width): gate|up rows and down columns are
narrowed at load, and the output is all-reduced (each rank's sum over its slice of every expert).
"""

from __future__ import annotations

import itertools
import weakref

import torch
import torch.nn.functional as F
from torch import nn

from aserve.distributed.collectives import all_reduce
from aserve.distributed.context import ParallelContext, shard_along
from aserve.kernels import reference
from aserve.model.layers.custom_op import CustomOp
from aserve.model.quantization.base import LinearMethodBase, drop_weights, register_weight
from aserve.model.quantization.unquantized import UnquantizedLinearMethod

_UNQUANTIZED = UnquantizedLinearMethod()
_LAYER_KEYS = itertools.count()
_LAYERS: dict[int, weakref.ref] = {}  # layer_key -> FusedMoE, for the opaque op under torch.compile


def select_experts(router_logits: torch.Tensor, top_k: int, renormalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """`(weights [T, k] float32, expert ids [T, k] int64)`: the softmax (in float32) of `router_logits
    [T, E]`, its `top_k` largest, renormalized to sum 1 per token when `renormalize`."""
    probs = torch.softmax(router_logits.float(), dim=-1)
    weights, ids = torch.topk(probs, top_k, dim=-1)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights, ids


class ExpertProjection(nn.Module):
    """One expert's projection as a `LinearMethodBase` sees a `Linear`: `weight [output, input]` (a
    view of the layer's stacked parameter until the method re-lays it out) and the attributes
    methods read."""

    def __init__(self, weight: torch.Tensor, dtype: torch.dtype, float_output: bool):
        super().__init__()
        self.output_size, self.input_size = weight.shape
        self.params_dtype = dtype
        self.float_output = float_output
        self.bias = None
        register_weight(self, "weight", weight)


class FusedMoE(CustomOp):
    """`forward(x [T, H], topk_weights [T, k], topk_ids [T, k]) -> [T, H]`: each token's sum over its
    experts of `weight * down(silu(gate(x)) * up(x))`. The result is in x's dtype, or float32 where
    the loader set `float_output` (bf16 on CPU with the C kernels: it feeds only the residual add
    and RMSNorm, which take float32 rows)."""

    def __init__(self, num_experts: int, hidden_size: int, intermediate_size: int, dtype: torch.dtype):
        super().__init__()
        self.num_experts = num_experts
        self.hidden_size = hidden_size
        self.intermediate_size = intermediate_size
        self.params_dtype = dtype
        self.gate_up_proj = nn.Parameter(torch.empty(num_experts, 2 * intermediate_size, hidden_size, dtype=dtype),
                                         requires_grad=False)
        self.down_proj = nn.Parameter(torch.empty(num_experts, hidden_size, intermediate_size, dtype=dtype),
                                      requires_grad=False)
        self.quant_method: LinearMethodBase = _UNQUANTIZED
        self.float_output = False
        # After process_weights_after_loading with a method other than the plain one: per expert.
        self.gate_up_experts: nn.ModuleList | None = None
        self.down_experts: nn.ModuleList | None = None
        self.layer_key = next(_LAYER_KEYS)
        _LAYERS[self.layer_key] = weakref.ref(self, lambda _, key=self.layer_key: _LAYERS.pop(key, None))
        self._fused_experts = None
        self.parallel: ParallelContext | None = None  # set by the loader with more than one rank
        if self.form == "cuda":
            from aserve.kernels.fused_moe import fused_experts  # Triton: imported only where it runs

            self._fused_experts = fused_experts

    # -- loading ----------------------------------------------------------------------------------
    def set_tensor_parallel(self, ctx: ParallelContext) -> None:
        """Split every expert's intermediate dim across `ctx`'s ranks (before loading weights)."""
        self.parallel = ctx

    def _rank_slice(self, loaded: torch.Tensor, dim: int) -> torch.Tensor:
        return loaded if self.parallel is None else shard_along(loaded, dim, self.parallel)

    def shards_of(self, param_name: str) -> int:
        """How many checkpoint tensors fill each expert's slice of parameter `param_name`."""
        return 2 if param_name == "gate_up_proj" else 1

    def load_shard(self, param: torch.Tensor, loaded: torch.Tensor, shard_id: int | None = None) -> None:
        """An already-stacked checkpoint tensor (`[E, 2I, H]` / `[E, H, I]`, transformers' in-memory form)."""
        if shard_id is not None:
            raise ValueError(f"stacked expert weights take no shard id (got {shard_id})")
        if self.parallel is not None and param is self.gate_up_proj:  # gate rows, then up rows: each split
            halves = loaded.chunk(2, dim=1)
            loaded = torch.cat([self._rank_slice(h, 1) for h in halves], dim=1)
        elif self.parallel is not None:  # down_proj [E, H, I]
            loaded = self._rank_slice(loaded, 2)
        _copy_checked(param.data, loaded)

    def load_expert_shard(self, param: torch.Tensor, loaded: torch.Tensor, expert_id: int,
                          shard_id: int | None) -> None:
        """Copy expert `expert_id`'s tensor into its slice of `param`: shard 0 (gate) / 1 (up) of
        `gate_up_proj`, or the whole `down_proj` slice (`shard_id` None). Raises ValueError on an
        expert id out of range or a shape mismatch."""
        if not 0 <= expert_id < self.num_experts:
            raise ValueError(f"expert {expert_id} out of range: the layer has {self.num_experts} experts")
        dst = param.data[expert_id]
        if shard_id is not None:
            dst = dst.narrow(0, shard_id * self.intermediate_size, self.intermediate_size)
        _copy_checked(dst, self._rank_slice(loaded, 0 if param is self.gate_up_proj else 1))

    # -- methods ----------------------------------------------------------------------------------
    def set_quant_method(self, method: LinearMethodBase) -> None:
        """Apply `method` to every expert projection (before loading or after: it takes the float
        weights as loaded). Raises TypeError for methods with their own checkpoint tensors (GGUF)."""
        if not isinstance(method, UnquantizedLinearMethod):
            raise TypeError(f"MoE experts cannot take the {method.name!r} method (it loads its own tensors)")
        self.quant_method = method

    def process_weights_after_loading(self) -> None:
        """With a method other than the plain float one: one `ExpertProjection` per expert and
        projection, each processed by the method; the stacked parameters are dropped."""
        if type(self.quant_method) is UnquantizedLinearMethod:
            return
        method, dtype, out32 = self.quant_method, self.params_dtype, self.float_output
        gate_up = [ExpertProjection(self.gate_up_proj.data[e], dtype, out32) for e in range(self.num_experts)]
        down = [ExpertProjection(self.down_proj.data[e], dtype, out32) for e in range(self.num_experts)]
        for proj in (*gate_up, *down):
            method.process_weights_after_loading(proj)
        drop_weights(self, keep=())
        self.gate_up_experts, self.down_experts = nn.ModuleList(gate_up), nn.ModuleList(down)

    # -- forward ----------------------------------------------------------------------------------
    def forward(self, x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor) -> torch.Tensor:
        if self.form != "cuda" and torch.compiler.is_compiling():
            return torch.ops.aserve.moe_experts(x, topk_weights, topk_ids, self.layer_key)
        out = self._impl(x, topk_weights, topk_ids)
        return out if self.parallel is None else all_reduce(out, self.parallel)

    def forward_native(self, x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor) -> torch.Tensor:
        if self.gate_up_experts is None:
            return reference.fused_moe(x, self.gate_up_proj, self.down_proj, topk_weights, topk_ids)
        return self._grouped(x, topk_weights, topk_ids, reference.silu_and_mul, x.dtype)

    def forward_cpu(self, x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor) -> torch.Tensor:
        kernels = self.cpu_kernels
        act = reference.silu_and_mul
        if kernels is not None and self.params_dtype == torch.bfloat16 and x.dtype == torch.bfloat16:
            act = kernels.silu_and_mul  # bf16 or float32 rows in, bf16 out, one rounding
        return self._grouped(x, topk_weights, topk_ids, act, torch.float32 if self.float_output else x.dtype)

    def forward_cuda(self, x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor) -> torch.Tensor:
        return self._fused_experts(x, self.gate_up_proj, self.down_proj, topk_weights, topk_ids)

    def _grouped(self, x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor, act,
                 out_dtype: torch.dtype) -> torch.Tensor:
        if self.gate_up_experts is None:  # plain float weights: slices of the stacked ones
            w13, w2 = self.gate_up_proj, self.down_proj

            def expert(e: int, rows: torch.Tensor) -> torch.Tensor:
                return F.linear(act(F.linear(rows, w13[e])), w2[e])
        else:
            method, gate_up, down = self.quant_method, self.gate_up_experts, self.down_experts

            def expert(e: int, rows: torch.Tensor) -> torch.Tensor:
                return method.apply(down[e], act(method.apply(gate_up[e], rows, None)), None)

        return reference.grouped_moe(x, topk_weights, topk_ids, self.num_experts, expert, out_dtype)

    def extra_repr(self) -> str:
        return (f"experts={self.num_experts}, hidden={self.hidden_size}, intermediate={self.intermediate_size}, "
                f"form={self.form}, method={self.quant_method.name}")


@torch.library.custom_op("aserve::moe_experts", mutates_args=())
def _moe_experts_op(x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor,
                    layer_key: int) -> torch.Tensor:
    layer = _LAYERS[layer_key]()
    assert layer is not None, "the MoE layer of a compiled graph was freed"
    return layer._impl(x, topk_weights, topk_ids).to(x.dtype)


@_moe_experts_op.register_fake
def _(x, topk_weights, topk_ids, layer_key):
    return torch.empty_like(x)


def _copy_checked(dst: torch.Tensor, src: torch.Tensor) -> None:
    if tuple(dst.shape) != tuple(src.shape):
        raise ValueError(f"checkpoint tensor has shape {tuple(src.shape)}, expected {tuple(dst.shape)}")
    dst.copy_(src)
