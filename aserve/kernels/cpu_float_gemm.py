"""Prefill-sized products on CPUs whose packed products are the AVX2 form (fp32 FMAs on weights widened in
registers, `cpu_matmul_avx2.c`), part of `CpuKernels` (cpu_ops.py): from `FLOAT_GEMM_MIN_ROWS` rows on, the
packed weight is turned once per call into its float32 transpose (bf16 widened exactly: `unpack_vnni_f32` in
cpu_matmul.c; 4-bit codes dequantized as `q * scale + offset`: `unpack_int4_f32` in cpu_matmul_avx2.c) and
multiplied by torch's float32 GEMM (MKL / oneDNN), whose register blocking reaches more of the FMA peak than the
widening kernels do at large M; below that the conversion costs more than it gains and the kernels keep the
rows. The README's CPU section has the measured crossover.

Results: fp32 accumulation and one rounding, as the kernels', but in the GEMM library's order of sums, which
depends on the batch: a row's value is not bitwise the same alone (the kernel) as in a prefill-sized batch.
CPUs with a bf16 dot product (AVX512-BF16) keep the kernels at every size: there they run at the bf16 peak."""

from __future__ import annotations

import ctypes
from collections.abc import Callable

import torch

FLOAT_GEMM_MIN_ROWS = 128  # rows from which the float32 GEMM wins on the AVX2 form (README: measured)
FLOAT_GEMM_SLAB_BYTES = 8 << 20  # the float32 copy is made a slab of columns at a time: memory stays bounded

_P, _I = ctypes.c_void_p, ctypes.c_int64
FLOAT_GEMM_SIGNATURES = {"unpack_vnni_f32": (_P, _I, _I, _I, _P), "unpack_int4_f32": (_P, _P, _P, _I, _I, _I, _I, _P)}


class FloatGemm:
    """The float32-GEMM forms of `linear_vnni` and `linear_int4`; `_bind_float_gemm` takes the loaded library
    (typed by CpuKernels)."""

    packed_isa: str | None

    def _bind_float_gemm(self, library: ctypes.CDLL) -> None:
        self._unpack_vnni = library.unpack_vnni_f32
        self._unpack_int4 = library.unpack_int4_f32
        self._unpack_int4.restype = ctypes.c_int64

    def takes_float_gemm(self, rows: int) -> bool:
        """Whether a packed product of `rows` rows runs as a float32 GEMM here (AVX2 form, >= FLOAT_GEMM_MIN_ROWS)."""
        return self.packed_isa == "avx2" and rows >= FLOAT_GEMM_MIN_ROWS

    def unpack_vnni(self, packed: torch.Tensor, g0: int = 0, ng: int | None = None) -> torch.Tensor:
        """Column groups `[g0, g0 + ng)` (all by default) of a `pack_vnni` weight `[N/16, K/2, 16, 2]` (bf16,
        contiguous) as their float32 transpose `[K, 16 ng]`."""
        ng = packed.shape[0] - g0 if ng is None else ng
        k = packed.shape[1] * 2
        wt = torch.empty((k, 16 * ng), dtype=torch.float32)
        self._unpack_vnni(packed.data_ptr(), k, g0, ng, wt.data_ptr())
        return wt

    def unpack_int4(self, packed: tuple[torch.Tensor, ...], g0: int = 0, ng: int | None = None) -> torch.Tensor:
        """Column groups `[g0, g0 + ng)` (all by default) of an AVX2-form `pack_int4` weight (codes, fp16 scale
        and offset) as `q * scale + offset`, float32 transposed: `[K, 16 ng]`."""
        codes, scale, offset = packed
        ng = codes.shape[0] - g0 if ng is None else ng
        k = codes.shape[1] * 4
        wt = torch.empty((k, 16 * ng), dtype=torch.float32)
        if self._unpack_int4(codes.data_ptr(), scale.data_ptr(), offset.data_ptr(), k, k // scale.shape[1], g0, ng,
                             wt.data_ptr()):
            raise RuntimeError("unpack_int4: this build's 4-bit codes are not in the AVX2 form's order")
        return wt

    def float_gemm_vnni(self, x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None,
                        out_dtype: torch.dtype) -> torch.Tensor:
        """`x [M, K]` (bf16, checked by the caller) times the packed weight, + bias, in `out_dtype`."""
        return _float_gemm(x, lambda g0, ng: self.unpack_vnni(packed, g0, ng), packed.shape[0], bias, out_dtype)

    def float_gemm_int4(self, x: torch.Tensor, packed: tuple[torch.Tensor, ...], bias: torch.Tensor | None,
                        out_dtype: torch.dtype) -> torch.Tensor:
        """`x [M, K]` (bf16, checked by the caller) times the dequantized 4-bit weight, + bias, in `out_dtype`
        (x exact here, where the 4-bit kernel rounds it to 15-bit integers per 32)."""
        return _float_gemm(x, lambda g0, ng: self.unpack_int4(packed, g0, ng), packed[0].shape[0], bias, out_dtype)


def _float_gemm(x: torch.Tensor, unpack: Callable[[int, int], torch.Tensor], groups: int, bias: torch.Tensor | None,
                out_dtype: torch.dtype) -> torch.Tensor:
    """x times the weight whose column groups `unpack(g0, ng)` gives as float32 `[K, 16 ng]`, a slab of at most
    FLOAT_GEMM_SLAB_BYTES at a time (one slab for a small model's layers; an LM head or a large model's MLP in
    several, each slab's product written into the one output as it comes)."""
    xf = x.float()
    per = max(1, FLOAT_GEMM_SLAB_BYTES // (x.shape[1] * 16 * 4))
    out = None if per >= groups else torch.empty((x.shape[0], 16 * groups), dtype=out_dtype)
    for g0 in range(0, groups, per):
        ng = min(per, groups - g0)
        wt = unpack(g0, ng)
        part = torch.mm(xf, wt) if bias is None else torch.addmm(bias[16 * g0:16 * (g0 + ng)].float(), xf, wt)
        if out is None:  # one slab
            return part if out_dtype == torch.float32 else part.to(out_dtype)
        out[:, 16 * g0:16 * (g0 + ng)].copy_(part)
    return out
