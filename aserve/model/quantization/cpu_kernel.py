"""bf16 Linear layers on CPU through aserve's C kernel (`aserve/kernels/cpu_ops.c`, `linear_bf16`) for
decode-sized batches, oneDNN (`F.linear`) for prefill-sized ones.

The kernel streams the Hugging Face-layout weight once per call with the CPU's bf16 dot-product
instructions and software prefetch. Measured on 2 vCPUs with AVX512-BF16 (all Linear weights of
SmolLM2-135M, 30 layers, `benchmarks`-style loop): 8.6 ms at 1 row vs 13.0 ms for oneDNN's pre-packed
weights and ~19 ms for `F.linear`; 19.8 vs 28.1 ms at 8 rows, about even at 16-32 rows; `F.linear` catches
up near 64 rows (106 vs 110 ms) and wins for prefill (343 vs 421 ms at 256 rows). So rows up to
`KERNEL_MAX_ROWS` go to the kernel, more to `F.linear` on the same weight (no second copy). Used only
where the kernel has native bf16 dot products (else oneDNN's packed form stays, `cpu_packed.py`).
Results: fp32 accumulation, one rounding; within a bf16 rounding of `F.linear`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

from aserve.kernels.cpu_ops import CpuKernels
from aserve.model.quantization.unquantized import UnquantizedLinearMethod

if TYPE_CHECKING:
    from aserve.model.layers.linear import Linear

KERNEL_MAX_ROWS = 48


def kernel_rows(kernels: CpuKernels, x: torch.Tensor) -> bool:
    """Whether `x` goes to the kernel: 2-D bf16 CPU rows with unit stride, at most KERNEL_MAX_ROWS."""
    return x.dim() == 2 and x.shape[0] <= KERNEL_MAX_ROWS and x.stride(1) == 1 and kernels.accepts(x)


class CpuKernelLinearMethod(UnquantizedLinearMethod):
    """The float weight as loaded (contiguous); decode-sized batches multiply in the C kernel.

    With `float_output`, those batches return the unrounded float32 product instead of bf16: for layers
    whose output only feeds ops that take float32 rows (the model's `float_output_modules`: RMSNorm after
    a residual-stream projection, the gated activation), which keeps a bf16 model closer to its fp32
    self (an exception to `LinearMethodBase.apply`'s "in x's dtype", for those layers only)."""

    name = "cpu_bf16_kernel"

    def __init__(self, kernels: CpuKernels, float_output: bool = False):
        # Shared and immutable: the method keeps no per-layer state.
        self.kernels = kernels
        self.out_dtype = torch.float32 if float_output else torch.bfloat16

    def process_weights_after_loading(self, layer: Linear) -> None:
        layer.weight.data = layer.weight.data.contiguous()

    def apply(self, layer: Linear, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        if kernel_rows(self.kernels, x):
            return self.kernels.linear(x, layer.weight, bias, self.out_dtype)
        return F.linear(x, layer.weight, bias)
