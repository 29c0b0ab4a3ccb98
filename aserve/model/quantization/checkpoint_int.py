"""The Linear method of pre-quantized checkpoints (GPTQ, AWQ, compressed-tensors `pack-quantized`): every
format is converted at load (`checkpoint_formats.py`) to one canonical form, which this method holds
and turns into aserve's CPU group-wise 4-bit kernel operands (`int4_cpu.pack_int4`).

Canonical form, per layer (output dim first, so a `MergedLinear` stacks q|k|v / gate|up shards along
dim 0 through its usual `load_shard`):
  `qcodes`  uint8 `[N, K]`  the integer codes, input columns in *group order*
  `qscales` fp32  `[N, G]`  one scale per output row and group of `group_size` columns
  `qzeros`  fp32  `[N, G]`  the integer zero point: `w[n, k] = (q[n, k] - zero[n, g]) * scale[n, g]`
  `input_perm` (buffer, only for GPTQ act-order): the column permutation that put the columns in group
  order; the activations are permuted with it once per layer call (`x.index_select(-1, perm)`).
Groups are contiguous runs of `group_size` columns, the last one possibly shorter (GPTQ's
`ceil(K / group_size)` groups); `group_size` -1 is one group over K.

After loading, 4-bit layers the kernel takes (N % 16 == 0, K % 32 == 0, every group boundary a
multiple of 32) go to the kernel with one scale and offset (`-zero * scale`) per format group when the
group size is one of `NATIVE_GROUP_SIZES` and divides K, else per 32-column sub-group (the format
group's repeated, exact). aserve's C kernel keeps them in fp16 (a checkpoint's scales rounded to fp16,
a relative 2^-11 at most: below the bf16 activations' own rounding). 8-bit channel-wise symmetric layers (one group,
every zero point 128: compressed-tensors W8A16 channel, symmetric GPTQ 8-bit with group_size -1) keep
their codes as int8 `q - 128` with per-row scales in the model dtype and multiply in the int8
weight-only kernel (`int8.int8_linear`, `_weight_int8pack_mm`), 1 byte a weight. Any other layer
(group-wise or asymmetric 8-bit, other shapes) keeps the dequantized weight in the model dtype and
`F.linear`, logged once per reason.

On CUDA (`cuda_linear.py`) every 4- and 8-bit layer is packed for the Triton dequant-GEMM
(`aserve/kernels/dequant_gemm.py`) instead, unless its group size is not a multiple of 16 (then the
dequantized weight); checked under the Triton interpreter, not yet run on a GPU.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

from aserve.model.quantization import cuda_linear
from aserve.model.quantization.base import LinearMethodBase, drop_weights, register_weight
from aserve.model.quantization.int4_cpu import GROUP_SIZE, int4_linear, int4_packable, pack_int4
from aserve.model.quantization.int8 import int8_linear

if TYPE_CHECKING:
    from aserve.model.layers.linear import Linear

logger = logging.getLogger(__name__)
_logged: set[str] = set()
# Format group sizes the 4-bit kernels take as they are (one scale per group); others are repeated over groups of 32.
NATIVE_GROUP_SIZES = (32, 64, 128, 256)


def num_groups(input_size: int, group_size: int) -> int:
    """How many groups a K-column weight has (`group_size` -1: one)."""
    return 1 if group_size == -1 else -(-input_size // group_size)


def dequantize(codes: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, group_size: int) -> torch.Tensor:
    """The fp32 weight `(q - zero) * scale` of the canonical form (columns in group order)."""
    k = codes.shape[1]
    gs = k if group_size == -1 else group_size
    col_group = torch.arange(k, device=codes.device) // gs
    return (codes.float() - zeros.float()[:, col_group]) * scales.float()[:, col_group]


class CheckpointIntMethod(LinearMethodBase):
    """Integer weights read from a quantized checkpoint (see the module docstring)."""

    def __init__(self, name: str, bits: int, group_size: int):
        self.name = name
        self.bits = bits
        self.group_size = group_size

    def create_weights(self, layer: Linear, device: torch.device | str | None = None) -> None:
        n, k = layer.output_size, layer.input_size
        g = num_groups(k, self.group_size)
        register_weight(layer, "qcodes", torch.empty(n, k, dtype=torch.uint8, device=device))
        register_weight(layer, "qscales", torch.empty(n, g, dtype=torch.float32, device=device))
        register_weight(layer, "qzeros", torch.empty(n, g, dtype=torch.float32, device=device))

    @staticmethod
    def set_input_perm(layer: Linear, perm: torch.Tensor, where: str) -> None:
        """Record the act-order column permutation of `layer`; every shard of a fused layer must share it
        (ValueError otherwise: its columns could not be put in one group order)."""
        current = getattr(layer, "input_perm", None)
        if current is not None and not torch.equal(current, perm):
            raise ValueError(f"{where}: its act-order (g_idx) differs from the other projections fused with it; "
                             "this checkpoint cannot be served fused")
        layer.register_buffer("input_perm", perm.to(torch.int64), persistent=False)

    def process_weights_after_loading(self, layer: Linear) -> None:
        codes, scales, zeros = layer.qcodes.data, layer.qscales.data, layer.qzeros.data
        perm = getattr(layer, "input_perm", None)
        n, k = codes.shape
        drop_weights(layer)
        if perm is not None:  # set while reading the checkpoint, on the CPU
            layer.register_buffer("input_perm", perm.to(codes.device), persistent=False)
        if cuda_linear.use_cuda_forms(codes.device):  # the Triton dequant-GEMM (cuda_linear.py)
            reason = cuda_linear.pack_checkpoint_int(layer, codes, scales, zeros, self.bits, self.group_size)
            if reason is not None:
                cuda_linear.dequantized_fallback(self.name, reason, layer.params_dtype)
                register_weight(layer, "weight",
                                dequantize(codes, scales, zeros, self.group_size).to(layer.params_dtype))
            return
        if self.bits == 8 and scales.shape[1] == 1 and bool((zeros == 128).all()):
            register_weight(layer, "int8_weight", (codes.to(torch.int16) - 128).to(torch.int8).contiguous())
            register_weight(layer, "int8_scales", scales[:, 0].to(layer.params_dtype).contiguous())
            return
        reason = self._kernel_refusal(n, k)
        if reason is None:
            gs = k if self.group_size == -1 else self.group_size
            kernel_gs = gs if gs in NATIVE_GROUP_SIZES and k % gs == 0 else GROUP_SIZE
            sub = (torch.arange(k // kernel_gs) * kernel_gs) // gs  # each kernel group's format group
            s_k, z_k = scales[:, sub], zeros[:, sub]
            pack_int4(layer, codes, s_k, (8.0 - z_k) * s_k, layer.params_dtype, kernel_gs, exact=False)
            layer.int4_group_size = kernel_gs
            return
        key = f"{self.name}:{reason}"
        if key not in _logged:
            _logged.add(key)
            logger.info("--quantization %s: %s; such layers keep the dequantized weight in %s (F.linear)",
                        self.name, reason, layer.params_dtype)
        register_weight(layer, "weight", dequantize(codes, scales, zeros, self.group_size).to(layer.params_dtype))

    def _kernel_refusal(self, n: int, k: int) -> str | None:
        """Why the 4-bit kernel cannot take a `[n, k]` layer, or None."""
        if self.bits != 4:
            return f"{self.bits}-bit group-wise or asymmetric weights have no CPU kernel yet"
        if not int4_packable(n, k, GROUP_SIZE):
            return f"a [{n}, {k}] weight does not fit the 4-bit kernel (N % 16, K % 32)"
        if self.group_size != -1 and self.group_size % GROUP_SIZE:
            return f"group size {self.group_size} is not a multiple of the kernel's {GROUP_SIZE}"
        return None

    def apply(self, layer: Linear, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        perm = getattr(layer, "input_perm", None)
        if perm is not None:
            x = x.index_select(-1, perm)
        weight = getattr(layer, "weight", None)
        if weight is not None:
            return F.linear(x, weight, bias)
        if getattr(layer, "dq_weight", None) is not None:
            return cuda_linear.checkpoint_int_linear(layer, x, self.bits, self.group_size, bias)
        q8 = getattr(layer, "int8_weight", None)
        if q8 is not None:
            return int8_linear(x, q8, layer.int8_scales, bias)
        return int4_linear(layer, x, layer.int4_group_size, bias)
