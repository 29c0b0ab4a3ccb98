"""Group-wise 4-bit weights on CPU: aserve's C kernel (`cpu_ops.linear_int4`) for bf16 activations where
it is built (AVX512-BF16 or AVX2 + FMA, groups of a multiple of 32, fp16-exact scales), else torch's `_weight_int4pack_mm_for_cpu`,
and the packing each needs.

The kernel's weight form, per output row `n` and group `g` of `group_size` input columns:
`w[n, k] = (q[n, k] - 8) * scale[n, g] + zero[n, g]` with `q` in 0..15. GGUF's Q4_1 (`d * q + m`)
is that form with `scale = d, zero = m + 8 d`, and Q4_0 (`d * (q - 8)`) with `zero = 0`; group-wise
min/max quantization of a float weight produces it too (`quantize_int4`).

aserve's kernel multiplies the codes exactly and applies each group's scale and offset in fp32 (only
the activations are rounded: to bf16, and on AVX2 further to 15-bit integers per 32 for integer dot
products; from 128 rows on AVX2, prefill, the weight is dequantized to float32, `q * scale + offset`
rounded once, for torch's float32 GEMM with x as given: `kernels/cpu_float_gemm.py`); it may return
float32 for layers with `float_output`. torch's kernel
computes in the activation dtype, and its scales/zeros must be in that dtype: with bf16
activations it is the fast path (scales rounded to bf16); with fp32 activations it reproduces the
dequantized weight to float rounding, but its cost grows with every row (about 5 ms per row for a
576 x 1536 weight), so for fp32 activations `pack_int4` also keeps the unpacked codes and batches
of more than `FP32_KERNEL_MAX_ROWS` rows (prompts) multiply by the weight dequantized on the fly.
The kernel needs `output_size % 16 == 0` and `input_size % group_size == 0` (`int4_packable`).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from aserve.kernels import cpu_ops
from aserve.kernels.cpu_ops import CpuKernels
from aserve.model.quantization.base import register_weight

GROUP_SIZE = 32
FP32_KERNEL_MAX_ROWS = 4
_OUTPUT_MULTIPLE = 16  # _convert_weight_to_int4pack_for_cpu packs output rows in tiles of 16
_INNER_K_TILES = 1  # ignored by the CPU packing; the CUDA op's argument


def int4_packable(output_size: int, input_size: int, group_size: int = GROUP_SIZE) -> bool:
    """Whether a `[output_size, input_size]` weight fits the CPU int4 kernel."""
    return output_size % _OUTPUT_MULTIPLE == 0 and input_size % group_size == 0 and input_size % 2 == 0


def quantize_int4(weight: torch.Tensor, group_size: int = GROUP_SIZE) -> tuple[torch.Tensor, ...]:
    """Asymmetric min/max quantization of `weight [N, K]` per group of `group_size` columns.

    Returns `(q uint8 [N, K] in 0..15, scale fp32 [N, K/group], zero fp32 [N, K/group])` in the
    kernel's form (see the module docstring), with the scale and the group minimum exact in fp16; a
    constant group gets scale 0 and is exact.
    """
    n, k = weight.shape
    w = weight.detach().float().reshape(n, k // group_size, group_size)
    lo, hi = w.amin(dim=-1), w.amax(dim=-1)
    # Scale and minimum in fp16 (as GGUF's Q4_1 stores them; aserve's C kernel streams them at that
    # width), rounded outwards so the group's range stays covered.
    lo = _to_fp16(lo, -1)
    scale = _to_fp16((hi - lo) / 15.0, +1)
    safe = torch.where(scale > 0, scale, torch.ones_like(scale))
    q = ((w - lo.unsqueeze(-1)) / safe.unsqueeze(-1)).round_().clamp_(0, 15).to(torch.uint8)
    return q.reshape(n, k), scale, lo + 8.0 * scale


def _to_fp16(x: torch.Tensor, direction: int) -> torch.Tensor:
    """`x` rounded to a float16 value, never below it (`direction` +1) or above it (-1); as float32."""
    rounded = x.half().float()
    wrong = rounded < x if direction > 0 else rounded > x
    nudged = (x + direction * x.abs() * 2**-10).half().float()
    return torch.where(wrong, nudged, rounded)


def dequantize_int4(q: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor,
                    group_size: int = GROUP_SIZE) -> torch.Tensor:
    """The fp32 weight `[N, K]` that `(q, scale, zero)` stand for (the kernel's reference)."""
    n, k = q.shape
    shape = (n, k // group_size, group_size)
    scale3 = scale.float().unsqueeze(-1).expand(shape)
    offset3 = (zero.float() - 8.0 * scale.float()).unsqueeze(-1).expand(shape)
    return torch.addcmul(offset3, q.reshape(shape).float(), scale3).reshape(n, k)


def _c_kernels(dtype: torch.dtype, group_size: int) -> CpuKernels | None:
    """aserve's C int4 kernel, where it applies: bf16 activations, groups of a multiple of 32, packed
    matrix products (AVX512-BF16 or AVX2)."""
    if dtype != torch.bfloat16 or group_size % 32:
        return None
    kernels = cpu_ops.load()
    return kernels if kernels is not None and kernels.packed_matmuls else None


def pack_int4(layer: torch.nn.Module, q: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor,
              dtype: torch.dtype, group_size: int = GROUP_SIZE, exact: bool = True) -> None:
    """Register the kernel's operands on `layer`. With bf16 activations where aserve's C kernel applies
    (`cpu_ops.linear_int4`: groups of a multiple of 32, AVX512-BF16 or AVX2): `int4_c_codes`, `int4_c_scale`, `int4_c_offset`
    (its packed form; it computes `sum(q x)` per group exactly and scales in fp32, so only x is rounded
    (prefill-sized batches on AVX2: see the module docstring), and it is 2x faster than torch's kernel
    at one row; `exact`: only when every scale and offset is
    exact in fp16, else they are rounded to fp16). Otherwise torch's: `int4_weight` (packed uint8)
    and `int4_scales_zeros` (`[K/group, N, 2]` in the activation dtype `dtype`); for fp32 also `int4_q`,
    `int4_scale`, `int4_zero` (the unpacked form, for prompts; see the module docstring)."""
    kernels = _c_kernels(dtype, group_size)
    if kernels is not None:
        c_form = kernels.pack_int4(q, scale, zero.float() - 8.0 * scale.float(), group_size, exact)
        if c_form is not None:
            for name, tensor in zip(("int4_c_codes", "int4_c_scale", "int4_c_offset"), c_form, strict=True):
                register_weight(layer, name, tensor)
            return
    packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(q.to(torch.int32).contiguous(), _INNER_K_TILES)
    scales_zeros = torch.stack([scale.float(), zero.float()], dim=-1).transpose(0, 1).contiguous().to(dtype)
    register_weight(layer, "int4_weight", packed)
    register_weight(layer, "int4_scales_zeros", scales_zeros)
    if dtype == torch.float32:
        register_weight(layer, "int4_q", q.to(torch.uint8).contiguous())
        register_weight(layer, "int4_scale", scale.float().contiguous())
        register_weight(layer, "int4_zero", zero.float().contiguous())


def int4_linear(layer: torch.nn.Module, x: torch.Tensor, group_size: int, bias: torch.Tensor | None) -> torch.Tensor:
    """`x [..., K] @ W.T (+ bias)` for a weight `pack_int4` registered on `layer`; x's dtype must be
    the one given to `pack_int4`."""
    lead = x.shape[:-1]
    x2 = x.reshape(-1, x.shape[-1])
    codes = getattr(layer, "int4_c_codes", None)
    if codes is not None:
        if torch.compiler.is_compiling():  # one opaque op in a compiled graph, bf16 out
            y = torch.ops.aserve.int4_linear_c(x2, codes, layer.int4_c_scale, layer.int4_c_offset, bias)
        else:
            float_out = getattr(layer, "float_output", False) and x.dim() == 2
            y = _int4_linear_c(x2, codes, layer.int4_c_scale, layer.int4_c_offset, bias, float_out)
        return y.reshape(*lead, y.shape[-1])
    if x2.dtype == torch.float32 and x2.shape[0] > FP32_KERNEL_MAX_ROWS:
        weight = dequantize_int4(layer.int4_q, layer.int4_scale, layer.int4_zero, group_size)
        return F.linear(x, weight, bias)
    if not x2.is_contiguous():
        x2 = x2.contiguous()
    y = torch.ops.aten._weight_int4pack_mm_for_cpu(x2, layer.int4_weight, group_size, layer.int4_scales_zeros)
    if bias is not None:
        y = y.add_(bias)
    return y.reshape(*lead, y.shape[-1])


def _int4_linear_c(x: torch.Tensor, codes: torch.Tensor, scale: torch.Tensor, offset: torch.Tensor,
                   bias: torch.Tensor | None, float_out: bool = False) -> torch.Tensor:
    kernels = cpu_ops.load()
    assert kernels is not None, "the C form exists only where the kernels were built"
    return kernels.linear_int4(x if x.stride(1) == 1 else x.contiguous(), (codes, scale, offset), bias,
                               torch.float32 if float_out else x.dtype)


@torch.library.custom_op("aserve::int4_linear_c", mutates_args=())
def _int4_linear_c_op(x: torch.Tensor, codes: torch.Tensor, scale: torch.Tensor, offset: torch.Tensor,
                      bias: torch.Tensor | None) -> torch.Tensor:
    return _int4_linear_c(x, codes, scale, offset, bias)


@_int4_linear_c_op.register_fake
def _(x, codes, scale, offset, bias):
    return x.new_empty((x.shape[0], codes.shape[0] * 16))
