"""bf16 Linear layers on CPU through aserve's C kernels (`aserve/kernels/cpu_ops.c`), used where they have
packed products (`CpuKernels.packed_matmuls`: AVX512-BF16 dot products, or fp32 FMAs on AVX2 + FMA,
`cpu_matmul_avx2.c`); elsewhere oneDNN's packed form stays where oneDNN has bf16 (`cpu_packed.py`).

After loading, the weight is re-laid out in pairs along K (`CpuKernels.pack_vnni`, `[N/16, K/2, 16, 2]`;
the Hugging Face copy is dropped) and every batch multiplies in `linear_vnni`: register blocks of 6 rows
x 64 columns fed by one broadcast pair of x per dot product, so the weight streams once per step at
decode sizes and prefill runs as fast as oneDNN (on AVX2, 4 rows x 16 columns per register block;
torch's bf16 `F.linear` there is emulated, slower; from 128 rows the AVX2 form hands the product to
torch's float32 GEMM on a widened copy of the weight, `kernels/cpu_float_gemm.py`, and a row's result
then depends on its batch). Measured on 2 vCPUs with AVX512-BF16 (all Linear
weights of SmolLM2-135M, 30 layers, one call each, a busy host): 10.3 ms at 1 row vs 14.6 ms for
oneDNN's pre-packed weights; 27.5 vs 32.1 ms at 16 rows; 88.9 vs 96.9 ms at 64; even at 256 (356 vs
352 ms). A weight whose shape does not pack (N not a multiple of 16, K odd) keeps the Hugging Face
layout: `linear_bf16` for up to `KERNEL_MAX_ROWS` rows, `F.linear` beyond.

Results: fp32 accumulation, one rounding; within a bf16 rounding of `F.linear`. Layers with
`float_output` (the loader sets it for the model's `float_output_modules`, whose output feeds only an
RMSNorm or the gated activation, which take float32 rows) return the unrounded float32 product instead.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

from aserve.kernels.cpu_ops import CpuKernels
from aserve.model.quantization.base import drop_weights, register_weight
from aserve.model.quantization.unquantized import UnquantizedLinearMethod

if TYPE_CHECKING:
    from aserve.model.layers.linear import Linear

KERNEL_MAX_ROWS = 48  # unpacked weights: rows beyond this go to F.linear (measured crossover)


def kernel_rows(kernels: CpuKernels, x: torch.Tensor) -> bool:
    """Whether `x` goes to the unpacked kernel: 2-D bf16 CPU rows with unit stride, at most KERNEL_MAX_ROWS."""
    return x.dim() == 2 and x.shape[0] <= KERNEL_MAX_ROWS and kernels.accepts(x)


def packed_linear(kernels: CpuKernels, x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None,
                  out_dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """`x [..., K]` (bf16) times a `pack_vnni` weight, any number of rows. `out_dtype` float32 applies to
    2-D rows in eager mode only (the consumers' float32 forms are the C kernels, which run there); under
    torch.compile this is one opaque op with a bf16 result."""
    if torch.compiler.is_compiling():
        return torch.ops.aserve.vnni_linear(x, packed, bias)
    if x.dim() == 2 and x.stride(1) == 1:
        return kernels.linear_vnni(x, packed, bias, out_dtype)
    out = kernels.linear_vnni(x.reshape(-1, x.shape[-1]).contiguous(), packed, bias)
    return out.view(*x.shape[:-1], out.shape[-1])


@torch.library.custom_op("aserve::vnni_linear", mutates_args=())
def _vnni_linear_op(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    from aserve.kernels import cpu_ops

    kernels = cpu_ops.load()
    assert kernels is not None, "a packed weight exists only where the kernels were built"
    return packed_linear(kernels, x, packed, bias)


@_vnni_linear_op.register_fake
def _(x, packed, bias):
    return x.new_empty((*x.shape[:-1], packed.shape[0] * 16))


class CpuKernelLinearMethod(UnquantizedLinearMethod):
    """The float weight as loaded, then packed for `linear_vnni` (see the module docstring); float32
    output for layers with `float_output` (2-D rows in eager mode)."""

    name = "cpu_bf16_kernel"

    def __init__(self, kernels: CpuKernels):
        self.kernels = kernels  # shared and immutable: the method keeps no per-layer state

    def process_weights_after_loading(self, layer: Linear) -> None:
        packed = self.kernels.pack_vnni(layer.weight.data)
        if packed is None:
            layer.weight.data = layer.weight.data.contiguous()
            return
        drop_weights(layer)
        register_weight(layer, "vnni_weight", packed)

    def apply(self, layer: Linear, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        out_dtype = torch.float32 if layer.float_output else torch.bfloat16
        packed = getattr(layer, "vnni_weight", None)
        if packed is not None:
            return packed_linear(self.kernels, x, packed, bias, out_dtype)
        if kernel_rows(self.kernels, x):
            return self.kernels.linear(x, layer.weight, bias, out_dtype)
        return F.linear(x, layer.weight, bias)
