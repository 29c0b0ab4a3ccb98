"""aserve's C kernels for the CPU decode step (bf16 activations), built at first use and called via ctypes.

Each op of a decode layer that is not a matmul (residual add + RMSNorm, rotary, SiLU-and-mul, paged
decode attention that reads the KV blocks in place) is one C call instead of 5-20 torch ops (a bf16
step at batch 1 was mostly per-op overhead: 11.9 of 30 ms on 2 vCPUs), and the matrix products
(bf16 weights packed in K-pairs, group-wise 4-bit weights) run on the CPU's bf16 dot-product
instructions. Sources: `cpu_ops.c` (small ops), `cpu_matmul.c` (matrix products) and
`cpu_decode_step.c` (a decode step's layers in one call, `aserve/runner/cpu_decode_step.py`), sharing
`cpu_common.h`, next to this file; compiled with the system C compiler (`$CC`, else `cc`) for this CPU
(`-march=native`) into `$ASERVE_CACHE_DIR/kernels` (default `~/.cache/aserve/kernels`), keyed by source,
compiler, flags and CPU, so later starts only load it (~1 s the first time).

`load()` returns None (and the layers keep their torch forms) when there is no compiler, the build
fails, `ASERVE_CPU_KERNELS=0` or `ASERVE_FORCE_NATIVE_OPS=1`; the reason is logged once. The wrappers
here check what keeps the C side inside its buffers; the C side trusts them. Results are fp32 inside
with one rounding per output.
"""

from __future__ import annotations

import ctypes
import functools
import logging
import subprocess
from pathlib import Path

import torch

from aserve.kernels.c_build import DISABLE_ENV, FORCE_NATIVE_ENV, compile_library, kernels_disabled
from aserve.kernels.c_build import log_once as _log_once
from aserve.kernels.cpu_float_gemm import FLOAT_GEMM_MIN_ROWS, FLOAT_GEMM_SIGNATURES, FloatGemm
from aserve.kernels.cpu_q8 import Q8_SIGNATURES, Q8Products

logger = logging.getLogger(__name__)

_HERE = Path(__file__).parent
_SOURCES = tuple(_HERE / name for name in ("cpu_ops.c", "cpu_matmul.c", "cpu_matmul_avx2.c", "cpu_attention.c",
                                            "cpu_attention_avx2.c", "cpu_prefill_attention.c", "cpu_decode_step.c",
                                            "cpu_decode_moe.c", "cpu_decode_team.c", "cpu_matmul_q8.c"))
# (all include cpu_common.h)
_HEADERS = (_HERE / "cpu_common.h", _HERE / "cpu_decode.h", _HERE / "cpu_team.h")

_BF16 = torch.bfloat16
_ROW_DTYPES = (torch.bfloat16, torch.float32)  # inputs the norm and the activation take
_is_compiling = torch.compiler.is_compiling
_P, _I, _F = ctypes.c_void_p, ctypes.c_int64, ctypes.c_float
_SIGNATURES = {
    "add_rms_norm_bf16": (_P, _I, _I, _P, _I, _I, _P, _P, _P, _I, _I, _F, _F),
    "rotary_neox_bf16": (_P, _I, _P, _I, _P, _P, _P, _I, _I, _I, _I, _I),
    "silu_and_mul_bf16": (_P, _I, _I, _P, _I, _I),
    "gelu_tanh_and_mul_bf16": (_P, _I, _I, _P, _I, _I),
    "linear_bf16": (_P, _I, _P, _P, _P, _I, _I, _I, _I, _I),
    "linear_vnni_bf16": (_P, _I, _P, _P, _P, _I, _I, _I, _I, _I),
    "linear_int4_bf16": (_P, _I, _P, _P, _P, _P, _P, _I, _I, _I, _I, _I, _I),
    **Q8_SIGNATURES,
    **FLOAT_GEMM_SIGNATURES,
    "paged_decode_attention_bf16": (_P, _P, _P, _P, _P, _I, _P, _P, _P, _I, _P, _I, _I, _I, _I, _I, _I, _I, _F, _F),
    "paged_prefill_attention_bf16": (_P, _I, _P, _P, _P, _P, _I, _P, _P, _I, _I, _I, _I, _I, _I, _I, _F, _F),
}


def load() -> CpuKernels | None:
    """The compiled kernels, or None where they are switched off or cannot be built here (the reason
    is logged once per process)."""
    if kernels_disabled():
        _log_once(logging.INFO, f"CPU kernels: off ({DISABLE_ENV}=0 or {FORCE_NATIVE_ENV}=1); ops use torch forms")
        return None
    return _load_native()


@functools.cache
def _load_native() -> CpuKernels | None:
    try:
        kernels = build("native")
    except (OSError, subprocess.CalledProcessError) as e:
        detail = (getattr(e, "stderr", "") or str(e)).strip()[:500]
        _log_once(logging.WARNING, f"CPU kernels: cannot build ({detail}); ops use their slower torch forms")
        return None
    gemm = f"; from {FLOAT_GEMM_MIN_ROWS} rows a float32 GEMM" if kernels.takes_float_gemm(FLOAT_GEMM_MIN_ROWS) else ""
    _log_once(logging.INFO, f"CPU kernels: built for this CPU (native bf16 dot product: {kernels.native_bf16_dot}; "
                            f"packed matrix products: {kernels.packed_isa or 'none'}{gemm})")
    return kernels


def build(march: str = "native") -> CpuKernels:
    """Compile (or reuse from the cache) the kernels for `-march=<march>` and load them; raises OSError
    (no compiler, cannot load) or CalledProcessError (the compiler failed). Tests build other ISAs
    (`x86-64-v2`, `x86-64-v3`) to check the portable code paths on any x86 CPU."""
    return CpuKernels(compile_library("cpu_ops", _SOURCES, _HEADERS, march))




def _fp16_exact(t: torch.Tensor) -> bool:
    return bool(torch.equal(t.float().half().float(), t.float()))


class CpuKernels(Q8Products, FloatGemm):
    """Typed wrappers over the compiled library (see cpu_ops.c for each contract).

    Inputs must be bfloat16 CPU tensors in the layouts stated below (callers check with `accepts`
    before choosing this path; the wrappers check only what keeps the C side inside its buffers).
    """

    def __init__(self, library: ctypes.CDLL):
        for name, argtypes in _SIGNATURES.items():
            fn = getattr(library, name)
            fn.argtypes, fn.restype = argtypes, None
        self._norm = library.add_rms_norm_bf16
        self._rotary = library.rotary_neox_bf16
        self._silu = library.silu_and_mul_bf16
        self._gelu_tanh = library.gelu_tanh_and_mul_bf16
        self._attend = library.paged_decode_attention_bf16
        self._attend_prefill = library.paged_prefill_attention_bf16
        self._attend_prefill.restype = ctypes.c_int64
        self._linear = library.linear_bf16
        self._linear_vnni = library.linear_vnni_bf16
        self._linear_vnni.restype = ctypes.c_int64
        self._linear_int4 = library.linear_int4_bf16
        self._linear_int4.restype = ctypes.c_int64
        self._bind_q8(library)
        self._bind_float_gemm(library)
        self.decode_layers = library.decode_layers_bf16  # typed by its caller (aserve/runner/cpu_decode_step.py)
        self.decode_layers.restype = ctypes.c_int64
        self.team_selftest = library.team_selftest  # (ops, chunks, threads, stall) -> chunks taken over, or < 0
        self.team_selftest.argtypes = (ctypes.c_int64,) * 4
        self.team_selftest.restype = ctypes.c_int64
        library.has_native_bf16_dot.restype = ctypes.c_int64
        library.packed_matmul_isa.restype = ctypes.c_int64
        # Whether `linear` runs on the CPU's bf16 dot-product instructions (else fp32 FMAs, slower than oneDNN).
        self.native_bf16_dot = bool(library.has_native_bf16_dot())
        # The form of the packed products (`linear_vnni`, `linear_int4`, and so the native decode step):
        # "avx512_bf16" (bf16 dot products), "avx2" (fp32 FMAs on exactly widened weights) or None (absent).
        self.packed_isa = {2: "avx512_bf16", 1: "avx2"}.get(int(library.packed_matmul_isa()))
        self.packed_matmuls = self.packed_isa is not None
        # The form of decode attention's items: "avx512_bf16" or "avx2" (both split a small batch's keys into
        # runs merged after; AVX2's split does not depend on the thread count), or None (portable loops).
        library.decode_attention_form.restype = ctypes.c_int64
        self.attention_isa = {2: "avx512_bf16", 1: "avx2"}.get(int(library.decode_attention_form()))

    @staticmethod
    def accepts_rows(x: torch.Tensor) -> bool:
        """Whether `x` can be the input of `rms_norm` / `silu_and_mul`: 2-D bf16 or float32 CPU rows
        with unit stride, not being traced by torch.compile."""
        return x.dtype in _ROW_DTYPES and x.dim() == 2 and x.is_cpu and x.stride(1) == 1 and not _is_compiling()

    @staticmethod
    def accepts(x: torch.Tensor, *more: torch.Tensor) -> bool:
        """Whether these tensors can go to the kernels: bfloat16, on the CPU, unit stride in the last
        dim, and not being traced by torch.compile."""
        if x.dtype != _BF16 or not x.is_cpu or x.stride(-1) != 1 or _is_compiling():
            return False
        for t in more:
            if t.dtype != _BF16 or not t.is_cpu or t.stride(-1) != 1:
                return False
        return True

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float,
                 residual: torch.Tensor | None = None,
                 weight_offset: float = 0.0) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """x `[T, N]` (bf16, or float32: a projection's unrounded output) -> bf16 `rms_norm(x) * weight [N]`;
        with `residual` (`[T, N]`, bf16 or float32): `(rms_norm(s) * weight, s)` for `s = x + residual` in
        float32, unrounded (so a model's residual stream stays float32 between layers). The scale is
        `weight_offset + weight` in float32 (Gemma's `1 + w`: pass 1.0)."""
        rows, n = x.shape
        if weight.shape[0] != n or x.dtype not in _ROW_DTYPES:
            raise ValueError(f"rms_norm: x {tuple(x.shape)} {x.dtype} needs weight [{n}] and bf16/float32 rows")
        out = torch.empty((rows, n), dtype=_BF16)
        x_f32 = x.dtype == torch.float32
        if residual is None:
            self._norm(x.data_ptr(), x.stride(0), x_f32, None, 0, 0, weight.data_ptr(), out.data_ptr(), None, rows,
                       n, eps, weight_offset)
            return out
        if residual.shape != x.shape or residual.stride(1) != 1 or residual.dtype not in _ROW_DTYPES:
            raise ValueError(f"rms_norm: residual {tuple(residual.shape)} {residual.dtype} must match x {tuple(x.shape)}")
        summed = torch.empty((rows, n), dtype=torch.float32)
        self._norm(x.data_ptr(), x.stride(0), x_f32, residual.data_ptr(), residual.stride(0),
                   residual.dtype == torch.float32, weight.data_ptr(), out.data_ptr(), summed.data_ptr(), rows, n, eps,
                   weight_offset)
        return out, summed

    def rotary_neox(self, q: torch.Tensor, k: torch.Tensor, cos_sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """q `[T, Hq, D]`, k `[T, Hk, D]` (heads packed within a token; tokens may be strided) and the
        step's rows `cos_sin [T, R]` (contiguous; R even <= D rotated dims, `cat(cos, sin)`) -> new
        contiguous rotated (q, k), neox style."""
        tokens, q_heads, head_dim = q.shape
        k_heads, rotated = k.shape[1], cos_sin.shape[1]
        if (q.stride(1) != head_dim or q.stride(2) != 1 or k.stride(1) != head_dim or k.stride(2) != 1
                or k.shape[0] != tokens or k.shape[2] != head_dim or cos_sin.shape[0] != tokens
                or not cos_sin.is_contiguous() or rotated % 2 or rotated > head_dim):
            raise ValueError(f"rotary: q {tuple(q.shape)}, k {tuple(k.shape)}, cos_sin {tuple(cos_sin.shape)} "
                             "do not fit [T, heads, D] with packed heads and [T, R <= D]")
        q_out = torch.empty((tokens, q_heads, head_dim), dtype=q.dtype)
        k_out = torch.empty((tokens, k_heads, head_dim), dtype=k.dtype)
        self._rotary(q.data_ptr(), q.stride(0), k.data_ptr(), k.stride(0), cos_sin.data_ptr(), q_out.data_ptr(),
                     k_out.data_ptr(), tokens, q_heads, k_heads, head_dim, rotated // 2)
        return q_out, k_out

    def linear(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
               out_dtype: torch.dtype = _BF16) -> torch.Tensor:
        """x `[M, K]` (unit stride within a row) @ weight `[N, K]`.T (+ bias `[N]`), weight and bias
        contiguous; fp32 accumulation, the result `[M, N]` in bf16 or float32 (`out_dtype`). Streams the
        weight once whatever M is: for decode-sized M (compute grows with M; oneDNN wins for prefill)."""
        rows, k = x.shape
        n = weight.shape[0]
        if x.stride(1) != 1 or weight.shape[1] != k or not weight.is_contiguous() or (
                bias is not None and (bias.shape[0] != n or not bias.is_contiguous())):
            raise ValueError(f"linear: x {tuple(x.shape)} does not fit weight {tuple(weight.shape)}")
        out = torch.empty((rows, n), dtype=out_dtype)
        self._linear(x.data_ptr(), x.stride(0), weight.data_ptr(), None if bias is None else bias.data_ptr(),
                     out.data_ptr(), n, rows, n, k, out_dtype == torch.float32)
        return out

    @staticmethod
    def pack_vnni(weight: torch.Tensor) -> torch.Tensor | None:
        """`weight [N, K]` (bf16) in the pair-interleaved layout `linear_vnni` takes, `[N/16, K/2, 16, 2]`
        (contiguous); None when N is not a multiple of 16 or K is odd."""
        n, k = weight.shape
        if n % 16 or k % 2:
            return None
        return weight.detach().reshape(n // 16, 16, k // 2, 2).permute(0, 2, 1, 3).contiguous()

    def linear_vnni(self, x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None = None,
                    out_dtype: torch.dtype = _BF16) -> torch.Tensor:
        """As `linear`, with the weight from `pack_vnni`: register blocks of 6 rows x 64 columns and no
        horizontal sums, so any M runs near the CPU's bf16 peak (for prefill as fast as oneDNN, for
        decode faster); with AVX2 only, blocks of 4 rows x 16 columns (one row: 64) in fp32 FMAs, and from
        FLOAT_GEMM_MIN_ROWS rows a float32 GEMM (cpu_float_gemm.py). Needs `packed_matmuls`."""
        rows, k = x.shape
        n = packed.shape[0] * 16
        if x.stride(1) != 1 or packed.shape[1] * 2 != k or (bias is not None and bias.shape[0] != n):
            raise ValueError(f"linear_vnni: x {tuple(x.shape)} does not fit packed weight {tuple(packed.shape)}")
        if self.takes_float_gemm(rows):
            return self.float_gemm_vnni(x, packed, bias, out_dtype)
        out = torch.empty((rows, n), dtype=out_dtype)
        status = self._linear_vnni(x.data_ptr(), x.stride(0), packed.data_ptr(),
                                   None if bias is None else bias.data_ptr(), out.data_ptr(), n, rows, n, k,
                                   out_dtype == torch.float32)
        if status:
            raise RuntimeError("linear_vnni: this build has no packed matrix products (AVX512-BF16 or AVX2)"
                               if status == -1 else "linear_vnni: out of memory")
        return out

    def pack_int4(self, q: torch.Tensor, scale: torch.Tensor, offset: torch.Tensor, group_size: int = 32,
                  exact: bool = True) -> tuple[torch.Tensor, ...] | None:
        """Group-wise 4-bit weights `w[n, k] = q[n, k] * scale[n, k // gs] + offset[n, k // gs]` (q uint8
        0..15 `[N, K]`, scale / offset float `[N, K/gs]`, gs = `group_size`, a multiple of 32) in the form
        `linear_int4` takes: codes `[N/16, K/4, 32]` uint8 (two codes a byte, in the order this build's form
        reads them: cpu_matmul.c for AVX512-BF16, cpu_matmul_avx2.c for AVX2) and scale /
        offset `[N/16, K/gs, 16]` fp16. None unless N % 16 == 0, K % gs == 0 and (with `exact`) every scale
        and offset is exact in fp16 (GGUF's Q4_0 / Q4_1 are; `quantize_int4` rounds its own to fp16);
        without `exact` they are rounded to fp16 (a checkpoint's own scales)."""
        n, k = q.shape
        gs = group_size
        if gs < 32 or gs % 32 or n % 16 or k % gs or scale.shape != (n, k // gs) or offset.shape != scale.shape:
            return None
        if self.packed_isa == "avx2":  # integer dot products (cpu_matmul_avx2.c): byte 4c + j of step t holds
            # k = 4t + j of column c (low nibble) and of column c + 8 (high nibble)
            codes = q.to(torch.uint8).reshape(n // 16, 2, 8, k // 4, 4)
            packed = (codes[:, 0] | (codes[:, 1] << 4)).permute(0, 2, 1, 3).contiguous()
        else:  # bf16 dot products (cpu_matmul.c): [N/16, 16 columns, K/4 steps, 2 halves, 2 (k within the pair)]
            codes = q.to(torch.uint8).reshape(n // 16, 16, k // 4, 2, 2)
            # byte (column c, pair position e) of step t: low nibble k = 4t + e, high nibble k = 4t + 2 + e
            packed = (codes[:, :, :, 0, :] | (codes[:, :, :, 1, :] << 4)).permute(0, 2, 1, 3).contiguous()

        def per_column_group(t: torch.Tensor) -> torch.Tensor:
            return t.half().reshape(n // 16, 16, k // gs).permute(0, 2, 1).contiguous()

        if exact and not (_fp16_exact(scale) and _fp16_exact(offset)):
            return None
        return packed.view(n // 16, k // 4, 32), per_column_group(scale), per_column_group(offset)

    def linear_int4(self, x: torch.Tensor, packed: tuple[torch.Tensor, ...], bias: torch.Tensor | None = None,
                    out_dtype: torch.dtype = _BF16) -> torch.Tensor:
        """x `[M, K]` (bf16 rows, unit stride) times a `pack_int4` weight (+ bias) -> `[M, N]` in bf16 or
        float32: exact-product sums of codes and x per group, scaled in fp32 (only x is rounded, as in
        the bf16 path); from FLOAT_GEMM_MIN_ROWS rows on the AVX2 form, a float32 GEMM of the dequantized
        weight (cpu_float_gemm.py). Needs `packed_matmuls`."""
        codes, scale, offset = packed
        rows, k = x.shape
        n, gs = codes.shape[0] * 16, k // scale.shape[1]  # the group size the scales were packed with
        if x.stride(1) != 1 or codes.shape[1] * 4 != k or (bias is not None and bias.shape[0] != n):
            raise ValueError(f"linear_int4: x {tuple(x.shape)} does not fit packed codes {tuple(codes.shape)}")
        if self.takes_float_gemm(rows) and gs and gs % 32 == 0 and k % gs == 0:
            return self.float_gemm_int4(x, packed, bias, out_dtype)
        out = torch.empty((rows, n), dtype=out_dtype)
        status = self._linear_int4(x.data_ptr(), x.stride(0), codes.data_ptr(), scale.data_ptr(), offset.data_ptr(),
                                   None if bias is None else bias.data_ptr(), out.data_ptr(), n, rows, n, k,
                                   out_dtype == torch.float32, gs)
        if status:
            raise RuntimeError({-1: "linear_int4: this build has no packed matrix products (AVX512-BF16 or AVX2)",
                                -3: f"linear_int4: group size {gs} is not a multiple of 32 dividing K={k}"}
                               .get(status, "linear_int4: out of memory"))
        return out

    def silu_and_mul(self, x: torch.Tensor) -> torch.Tensor:
        """x `[T, 2N]` (bf16 or float32, unit stride within a row) -> bf16 `silu(x[:, :N]) * x[:, N:]`."""
        return self._gated(self._silu, "silu_and_mul", x)

    def gelu_tanh_and_mul(self, x: torch.Tensor) -> torch.Tensor:
        """x `[T, 2N]` (as `silu_and_mul`) -> bf16 `gelu(x[:, :N], approximate="tanh") * x[:, N:]`."""
        return self._gated(self._gelu_tanh, "gelu_tanh_and_mul", x)

    @staticmethod
    def _gated(fn, name: str, x: torch.Tensor) -> torch.Tensor:
        rows, width = x.shape
        if x.stride(1) != 1 or width % 2 or x.dtype not in _ROW_DTYPES:
            raise ValueError(f"{name}: x {tuple(x.shape)} {x.dtype} needs unit stride, an even width, bf16/fp32")
        out = torch.empty((rows, width // 2), dtype=_BF16)
        fn(x.data_ptr(), x.stride(0), x.dtype == torch.float32, out.data_ptr(), rows, width // 2)
        return out

    def paged_decode_attention(self, q: torch.Tensor, kv_cache: torch.Tensor, block_tables: torch.Tensor,
                               seq_lens: torch.Tensor, scale: float, sliding_window: int | None = None,
                               new_kv: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
                               softcap: float | None = None) -> torch.Tensor:
        """One query token per sequence, q `[B, H, D]` (contiguous), against a layer's contiguous cache
        `[2, blocks, block_size, KVH, D]`: sequence b sees positions `[0, seq_lens[b])` through
        `block_tables[b]` (int32 rows with unit stride, every entry a valid block; int32 `seq_lens`,
        contiguous), only the last `sliding_window` of them when set. `new_kv = (k, v, slots)`, k/v
        `[B, KVH, D]` with packed heads and slots int64 `[B]` (-1: skipped), is written into the cache
        first. `softcap` caps the scores (`softcap * tanh(s / softcap)`). Returns `[B, H, D]`; H must be a
        multiple of KVH, at most 16 times it."""
        num_seqs, num_heads, head_dim = q.shape
        block_size, num_kv_heads = kv_cache.shape[2], kv_cache.shape[3]
        group = num_heads // num_kv_heads
        if (not q.is_contiguous() or not kv_cache.is_contiguous() or kv_cache.shape[4] != head_dim
                or group * num_kv_heads != num_heads or group > 16 or block_tables.shape[0] < num_seqs
                or seq_lens.shape[0] < num_seqs or block_tables.stride(1) != 1):
            raise ValueError(f"paged_decode_attention: q {tuple(q.shape)} does not fit cache {tuple(kv_cache.shape)}")
        half = kv_cache.stride(0)
        cache = kv_cache.data_ptr()
        out = torch.empty_like(q)
        if new_kv is None:
            new = (None, None, 0, None, 0)
        else:
            k, v, slots = new_kv
            if k.shape != (num_seqs, num_kv_heads, head_dim) or v.shape != k.shape or slots.shape[0] < num_seqs \
                    or k.stride(1) != head_dim or k.stride(2) != 1 or v.stride(1) != head_dim or v.stride(2) != 1:
                raise ValueError(f"paged_decode_attention: new k/v {tuple(k.shape)} must be "
                                 f"[{num_seqs}, {num_kv_heads}, {head_dim}] with packed heads")
            new = (slots.data_ptr(), k.data_ptr(), k.stride(0), v.data_ptr(), v.stride(0))
        self._attend(q.data_ptr(), out.data_ptr(), cache, cache + half * kv_cache.element_size(),
                     block_tables.data_ptr(), block_tables.stride(0), seq_lens.data_ptr(), new[0], new[1], new[2],
                     new[3], new[4], num_seqs, num_heads, num_kv_heads, head_dim, block_size, sliding_window or 0,
                     scale, softcap or 0.0)
        return out

    def paged_prefill_attention(self, q: torch.Tensor, kv_cache: torch.Tensor, block_tables: torch.Tensor,
                                seq_lens: torch.Tensor, query_start_loc: torch.Tensor, seqs: tuple[int, int],
                                out: torch.Tensor, scale: float, sliding_window: int | None = None,
                                softcap: float | None = None) -> bool:
        """Causal attention of the queries of sequences `seqs = (first, end)` into their rows of `out`.

        Sequence s's queries are rows `[query_start_loc[s], query_start_loc[s + 1])` of q `[T, H, D]`
        (heads packed, any token stride), the last of its `seq_lens[s]` positions, whose K/V (its new
        ones included) are in the layer's contiguous cache `[2, blocks, block_size, KVH, D]` through
        `block_tables[s]` (int32 rows, unit stride); a query at position p sees keys in
        `(p - sliding_window, p]`. `out` `[T, H, D]` contiguous. `query_start_loc` / `seq_lens`: contiguous
        int32. Returns False, with nothing written, where the kernel does not apply (no AVX512-BF16, head
        size not a multiple of 32 or above 256, more than 64 query heads a KV head); the caller then
        attends another way."""
        first, end = seqs
        if (q.dim() != 3 or kv_cache.dim() != 5 or kv_cache.shape[0] != 2 or not 0 <= first <= end
                or any(t.dtype != _BF16 for t in (q, kv_cache, out))
                or any(t.dtype != torch.int32 for t in (block_tables, seq_lens, query_start_loc))):
            raise ValueError(f"paged_prefill_attention: q {tuple(q.shape)} does not fit cache {tuple(kv_cache.shape)}")
        num_heads, head_dim = q.shape[1], q.shape[2]
        num_kv_heads = kv_cache.shape[3]
        if (q.stride(2) != 1 or q.stride(1) != head_dim or not kv_cache.is_contiguous() or not out.is_contiguous()
                or kv_cache.shape[4] != head_dim or out.shape != q.shape or num_heads % num_kv_heads
                or block_tables.stride(1) != 1 or block_tables.shape[0] < end or seq_lens.shape[0] < end
                or query_start_loc.shape[0] <= end or not query_start_loc.is_contiguous()
                or not seq_lens.is_contiguous() or int(query_start_loc[end]) > q.shape[0]
                or (end > first and int(seq_lens[first:end].max()) > block_tables.shape[1] * kv_cache.shape[2])):
            raise ValueError(f"paged_prefill_attention: q {tuple(q.shape)} does not fit cache {tuple(kv_cache.shape)}")
        cache = kv_cache.data_ptr()
        half = kv_cache.stride(0) * kv_cache.element_size()
        return self._attend_prefill(q.data_ptr(), q.stride(0), out.data_ptr(), cache, cache + half,
                                    block_tables.data_ptr(), block_tables.stride(0), query_start_loc.data_ptr(),
                                    seq_lens.data_ptr(), first, end, num_heads, num_kv_heads, head_dim,
                                    kv_cache.shape[2], sliding_window or 0, scale, softcap or 0.0) == 0
