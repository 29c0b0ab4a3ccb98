"""bf16 Linear weights pre-packed for oneDNN on CPU (the float path's CPU form).

torch's `F.linear` on bf16 CPU tensors re-lays the weight out on every call; oneDNN's packed form
(`mkldnn._reorder_linear_weight`, once) and `mkldnn._linear_pointwise` stream it much faster at the
batch sizes of decoding: measured on 2 vCPUs with AVX512-BF16, all Linear weights of SmolLM2 at
1 row 13.5 ms vs 19.3 ms, at 16 rows 31 vs 40 ms, the 49152-row LM head 1.1 vs 2.4 ms, with
bit-identical results. Used where oneDNN has bf16 kernels for this CPU (`cpu_packing_supported`)
unless `ASERVE_FORCE_NATIVE_OPS=1`; fp32 keeps `F.linear` (Hugging Face parity is asserted there).
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING

import torch

from aserve.model.layers.custom_op import FORCE_NATIVE_ENV
from aserve.model.quantization.base import drop_weights, register_weight
from aserve.model.quantization.unquantized import UnquantizedLinearMethod

if TYPE_CHECKING:
    from aserve.model.layers.linear import Linear

# The batch-size hint for packing; the packed weight serves any number of rows.
_PACK_HINT_ROWS = 1


def cpu_packing_supported(dtype: torch.dtype, device: torch.device | str) -> bool:
    """Whether bf16 weights on `device` get the packed form (see the module docstring)."""
    if os.environ.get(FORCE_NATIVE_ENV) == "1" or torch.device(device).type != "cpu" or dtype != torch.bfloat16:
        return False
    return torch.backends.mkldnn.is_available() and bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())


def pack_weight(weight: torch.Tensor) -> torch.Tensor:
    """`weight [out, in]` (bf16, CPU) in oneDNN's packed form, for `packed_linear`."""
    return torch.ops.mkldnn._reorder_linear_weight(weight.detach().contiguous(), _PACK_HINT_ROWS)


def packed_linear(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """`x [..., in] @ W.T (+ bias)` for a weight from `pack_weight`. Under torch.compile it is one
    opaque op (inductor's own lowering of the oneDNN call rejects these weights); eagerly it calls
    oneDNN directly (a custom op's dispatch costs ~8 us a call)."""
    if torch.compiler.is_compiling():
        return torch.ops.aserve.packed_linear(x, packed, bias, packed.shape[0])
    return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")


@torch.library.custom_op("aserve::packed_linear", mutates_args=())
def _packed_linear_op(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None,
                      out_features: int) -> torch.Tensor:
    return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")


@_packed_linear_op.register_fake
def _(x, packed, bias, out_features):
    return x.new_empty((*x.shape[:-1], out_features))


class CpuPackedLinearMethod(UnquantizedLinearMethod):
    """The float weight as loaded, then packed for oneDNN (the float `weight` parameter is dropped)."""

    name = "cpu_packed_bf16"

    def process_weights_after_loading(self, layer: Linear) -> None:
        packed = pack_weight(layer.weight.data)
        drop_weights(layer)
        register_weight(layer, "packed_weight", packed)

    def apply(self, layer: Linear, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        return packed_linear(x, layer.packed_weight, bias)
