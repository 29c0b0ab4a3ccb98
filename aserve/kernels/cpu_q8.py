"""The 8-bit products of aserve's C kernels (cpu_matmul_q8.c), part of `CpuKernels` (cpu_ops.py): GGUF's Q8_0
weights (codes with a scale per 32) times bf16 or fp32 rows, and the greedy LM head's screen over such a copy of
a bf16 head (model/layers/greedy_head.py)."""

from __future__ import annotations

import ctypes

import torch

_P, _I = ctypes.c_void_p, ctypes.c_int64
Q8_SIGNATURES = {
    "linear_q8_f32": (_P, _I, _I, _P, _P, _P, _I, _I, _I, _I),
    "screen_q8_bf16": (_P, _I, _P, _P, _I, _I, _I, _P, _P, _I, _P),
    "greedy_q8_bf16": (_P, _I, _P, _P, _P, _I, _I, _I, _P, _P, _I, _P),
}
_ROW_DTYPES = (torch.bfloat16, torch.float32)


class Q8Products:
    """The 8-bit wrappers; `_bind_q8` takes the loaded library (whose functions CpuKernels has typed)."""

    def _bind_q8(self, library: ctypes.CDLL) -> None:
        self._linear_q8 = library.linear_q8_f32
        self._linear_q8.restype = ctypes.c_int64
        self._screen_q8 = library.screen_q8_bf16
        self._screen_q8.restype = ctypes.c_int64
        self._greedy_q8 = library.greedy_q8_bf16
        self._greedy_q8.restype = ctypes.c_int64
        library.linear_q8_available.restype = ctypes.c_int64
        self.q8_products = bool(library.linear_q8_available())  # `linear_q8` (AVX2 integer products)

    @staticmethod
    def pack_q8(codes: torch.Tensor, scales: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | None:
        """`w[n, k] = codes[n, k] * scales[n, k // 32]` (int8 `[N, K]`, float `[N, K/32]`: GGUF's Q8_0) in the
        form `linear_q8` takes: codes `[N/32, K/2, 32, 2]` int8, scales `[N/32, K/32, 32]` fp32 (cpu_matmul_q8.c).
        None unless N % 32 == 0 and K % 32 == 0."""
        n, k = codes.shape
        if n % 32 or k % 32 or scales.shape != (n, k // 32):
            return None
        # each half of 32 columns in the order the kernel's in-lane widening reads them back in column order
        order = torch.tensor([0, 1, 2, 3, 8, 9, 10, 11, 4, 5, 6, 7, 12, 13, 14, 15])
        halves = codes.to(torch.int8).reshape(n // 32, 2, 16, k // 2, 2)[:, :, order]
        packed = halves.permute(0, 3, 1, 2, 4).reshape(n // 32, k // 2, 32, 2).contiguous()
        return packed, scales.float().reshape(n // 32, 32, k // 32).permute(0, 2, 1).contiguous()

    def linear_q8(self, x: torch.Tensor, packed: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        """x `[M, K]` (bf16 or float32 rows, unit stride) times a `pack_q8` weight -> float32 `[M, N]`: x
        rounded to int16 per group of 32 (finer than bf16), exact integer products per group, fp32 sums.
        Needs `q8_products`."""
        codes, scales = packed
        rows, k = x.shape
        n = codes.shape[0] * 32
        if x.stride(1) != 1 or codes.shape[1] * 2 != k or x.dtype not in _ROW_DTYPES:
            raise ValueError(f"linear_q8: x {tuple(x.shape)} {x.dtype} does not fit packed codes {tuple(codes.shape)}")
        out = torch.empty((rows, n), dtype=torch.float32)
        status = self._linear_q8(x.data_ptr(), x.stride(0), x.dtype == torch.float32, codes.data_ptr(),
                                 scales.data_ptr(), out.data_ptr(), n, rows, n, k)
        if status:
            raise RuntimeError("linear_q8: this build has no AVX2" if status == -1 else "linear_q8: out of memory")
        return out

    @staticmethod
    def quantize_q8(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """`weight` [N, K] (K % 32 == 0) as int8 codes [N, K] and float32 scales [N, K/32] with `w ~ codes * scale`,
        scale = max|w| / 127 per 32 (so |w - codes * scale| <= scale / 2, what `screen_q8` relies on)."""
        n, k = weight.shape
        groups = weight.float().view(n, k // 32, 32)
        scales = groups.abs().amax(dim=-1) / 127
        codes = torch.round(groups / scales.clamp_min(torch.finfo(torch.float32).tiny).unsqueeze(-1))
        return codes.clamp_(-127, 127).to(torch.int8).view(n, k), scales

    def screen_q8(self, x: torch.Tensor, packed: tuple[torch.Tensor, torch.Tensor], max_candidates: int
                  ) -> tuple[torch.Tensor, torch.Tensor]:
        """The columns that can hold each row's largest value of `x @ W^T` (x bf16 `[M, K]`, unit stride; packed:
        `pack_q8(*quantize_q8(W))`), from the 8-bit product and a bound on its error (cpu_matmul_q8.c): int32
        candidates `[M, max_candidates]` in column order and int64 counts `[M]`, -1 where a row has more than
        `max_candidates` (or a non-finite input) and must be computed in full. Needs `q8_products`."""
        codes, scales = packed
        rows, k = x.shape
        n = codes.shape[0] * 32
        if x.stride(1) != 1 or codes.shape[1] * 2 != k or x.dtype != torch.bfloat16:
            raise ValueError(f"screen_q8: x {tuple(x.shape)} {x.dtype} does not fit packed codes {tuple(codes.shape)}")
        work = torch.empty((rows, 2, n), dtype=torch.float32)
        cand = torch.empty((rows, max_candidates), dtype=torch.int32)
        counts = torch.empty(rows, dtype=torch.int64)
        status = self._screen_q8(x.data_ptr(), x.stride(0), codes.data_ptr(), scales.data_ptr(), rows, n, k,
                                 work.data_ptr(), cand.data_ptr(), max_candidates, counts.data_ptr())
        if status:
            raise RuntimeError("screen_q8: this build has no AVX2" if status == -1 else "screen_q8: out of memory")
        return cand, counts

    def greedy_q8(self, x: torch.Tensor, packed: tuple[torch.Tensor, torch.Tensor], vnni: torch.Tensor,
                  max_candidates: int) -> list[int]:
        """Each row's argmax of `linear_vnni(x, vnni)` (the first on ties) from `screen_q8`'s candidates (packed:
        the 8-bit copy of the same weight) and the exact products of their column groups alone; -1 for a row
        that must be computed in full (see `screen_q8`, or a non-finite value among its candidates)."""
        codes, scales = packed
        rows, k = x.shape
        n = codes.shape[0] * 32
        if (x.stride(1) != 1 or codes.shape[1] * 2 != k or x.dtype != torch.bfloat16
                or tuple(vnni.shape) != (n // 16, k // 2, 16, 2) or not vnni.is_contiguous()):
            raise ValueError(f"greedy_q8: x {tuple(x.shape)} {x.dtype} does not fit packed codes {tuple(codes.shape)} "
                             f"and weight {tuple(vnni.shape)}")
        work = torch.empty((rows, 2, n), dtype=torch.float32)
        cand = torch.empty((rows, max_candidates), dtype=torch.int32)
        tokens = torch.empty(rows, dtype=torch.int64)
        status = self._greedy_q8(x.data_ptr(), x.stride(0), codes.data_ptr(), scales.data_ptr(), vnni.data_ptr(),
                                 rows, n, k, work.data_ptr(), cand.data_ptr(), max_candidates, tokens.data_ptr())
        if status:
            raise RuntimeError({-1: "greedy_q8: this build has no AVX2 or no packed products",
                                -2: "greedy_q8: out of memory"}.get(int(status), f"greedy_q8: failed ({status})"))
        return tokens.tolist()
