"""W4A16 / W8A16 dequant-GEMM: `x [M, K]` (fp16 / bf16 / fp32) times an integer weight packed for the GPU,
dequantized tile by tile in registers, fp32 accumulation, output in x's dtype. The torch reference is
`reference.dequant_gemm`. Used on CUDA by the quantized-checkpoint Linear method (gptq / awq /
compressed-tensors pack-quantized; `aserve/model/quantization/cuda_linear.py`).

Weight form (`pack_codes`, converted at load from the canonical codes `[N, K]` of `checkpoint_int.py`):
  `qweight` int32 `[ceil(K / P), N]`, P = 32 / bits codes a word: word `(j, n)` holds the codes of input
            rows `k = P*j .. P*j + P-1` of output column n, code `i` in bits `[bits*i, bits*(i+1))`; a
            K that is not a multiple of P is padded with code 0 (its x columns are masked to 0);
  `scales`  fp32 `[G, N]`, `zeros` fp32 `[G, N]` (or None: symmetric, every zero `2**(bits-1)`):
            `w[k, n] = (q[k, n] - zeros[g, n]) * scales[g, n]`, `g = k // group_size` (group_size -1: one
            group over K; GPTQ's shorter last group works).
Each program computes a `BLOCK_M x BLOCK_N` tile of y, walking K by `BLOCK_K`: it loads x, the words
holding the tile's codes (each word once per code it holds, from cache), shifts and masks them, applies
the K-block's group scale / zero (a K-block lies in one group: `group_size % BLOCK_K == 0`), rounds the
dequantized tile to x's dtype and multiplies in `tl.dot` (fp32 operands in IEEE precision, not TF32).
Block sizes come from `block_config` (no autotuning).
"""

from __future__ import annotations

import torch

try:  # the CPU path needs no triton (the model imports this module on every platform)
    import triton
    import triton.language as tl

    from .triton_utils import (
        ACTIVATION_DTYPES,
        cdiv,
        check_same_device,
        check_tensor,
        dot_precision,
        launchable,
    )

    HAVE_TRITON = True
except ImportError:  # pragma: no cover - platforms without triton
    HAVE_TRITON = False

    def cdiv(a: int, b: int) -> int:
        return -(-a // b)

BITS = (4, 8)
MIN_BLOCK_K = 16  # tl.dot's smallest K tile: group sizes must be multiples of it


def codes_per_word(bits: int) -> int:
    if bits not in BITS:
        raise ValueError(f"bits: {bits} not in {BITS}")
    return 32 // bits


def pack_codes(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """uint8 codes `[N, K]` (each < 2**bits) -> the kernel's int32 `qweight [ceil(K / P), N]` (module docstring)."""
    per = codes_per_word(bits)
    n, k = codes.shape
    ct = codes.t()
    words = torch.zeros(cdiv(k, per), n, dtype=torch.int64, device=codes.device)  # < 2**32
    for i in range(per):  # one code position at a time: temporaries of K * N bytes, not 8x that
        part = ct[i::per]
        words[: part.shape[0]] |= part.to(torch.int64) << (bits * i)
    words = torch.where(words >= 2**31, words - 2**32, words)  # the same 32 bits as int32
    return words.to(torch.int32).contiguous()


def block_config(m: int, group_size: int) -> tuple[int, int, int]:
    """(BLOCK_M, BLOCK_N, BLOCK_K): 16-row tiles and narrow columns for decode (more programs over N),
    larger tiles for prefill; BLOCK_K the largest of 64 / 32 / 16 dividing the group size."""
    block_k = next(b for b in (64, 32, 16) if group_size == -1 or group_size % b == 0)
    if m <= 16:
        return 16, 32, block_k
    if m <= 32:
        return 32, 64, block_k
    return 64, 64, block_k


if HAVE_TRITON:
    @triton.jit
    def _dequant_gemm_kernel(
        x_ptr,  # [M, K]
        w_ptr,  # [ceil(K / P), N] int32
        s_ptr,  # [G, N] fp32
        z_ptr,  # [G, N] fp32; read only if HAS_ZEROS
        b_ptr,  # [N]; read only if HAS_BIAS
        y_ptr,  # [M, N]
        M,
        N,
        K,
        group_size,  # K for group_size -1
        stride_xm,
        stride_wk,
        stride_sg,
        stride_ym,
        BITS: tl.constexpr,
        PER: tl.constexpr,  # 32 // BITS codes a word
        MASK: tl.constexpr,  # 2**BITS - 1
        SYM_ZERO: tl.constexpr,  # 2**(BITS-1), the zero without HAS_ZEROS
        HAS_ZEROS: tl.constexpr,
        HAS_BIAS: tl.constexpr,
        BLOCK_M: tl.constexpr,
        BLOCK_N: tl.constexpr,
        BLOCK_K: tl.constexpr,
        PRECISION: tl.constexpr,
    ):
        rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
        cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
        row_mask = rows < M
        col_mask = cols < N
        offs_k = tl.arange(0, BLOCK_K)
        shifts = ((offs_k % PER) * BITS)[:, None]
        x_rows = x_ptr + rows.to(tl.int64)[:, None] * stride_xm
        acc = tl.full([BLOCK_M, BLOCK_N], 0.0, tl.float32)
        for k0 in range(0, K, BLOCK_K):
            ks = k0 + offs_k
            k_mask = ks < K
            x = tl.load(x_rows + ks[None, :], mask=row_mask[:, None] & k_mask[None, :], other=0.0)
            words = tl.load(w_ptr + (ks // PER).to(tl.int64)[:, None] * stride_wk + cols[None, :],
                            mask=k_mask[:, None] & col_mask[None, :], other=0)
            q = ((words >> shifts) & MASK).to(tl.float32)
            g = k0 // group_size
            s = tl.load(s_ptr + g * stride_sg + cols, mask=col_mask, other=0.0)
            if HAS_ZEROS:
                z = tl.load(z_ptr + g * stride_sg + cols, mask=col_mask, other=0.0)
                w = (q - z[None, :]) * s[None, :]
            else:
                w = (q - SYM_ZERO) * s[None, :]
            acc += tl.dot(x, w.to(x_ptr.dtype.element_ty), input_precision=PRECISION)
        if HAS_BIAS:
            acc += tl.load(b_ptr + cols, mask=col_mask, other=0.0).to(tl.float32)[None, :]
        tl.store(y_ptr + rows.to(tl.int64)[:, None] * stride_ym + cols[None, :], acc.to(y_ptr.dtype.element_ty),
                 mask=row_mask[:, None] & col_mask[None, :])


def check_weight(qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor | None, bits: int,
                 group_size: int, k: int) -> None:
    """ValueError naming the argument unless the packed weight fits `k` input columns (module docstring)."""
    per = codes_per_word(bits)
    check_tensor("qweight", qweight, 2, (torch.int32,))
    n = qweight.shape[1]
    if qweight.shape[0] != cdiv(k, per):
        raise ValueError(f"qweight: {tuple(qweight.shape)} does not hold {k} input rows of {bits}-bit codes "
                         f"(expected [{cdiv(k, per)}, N])")
    if group_size != -1 and (group_size <= 0 or group_size % MIN_BLOCK_K):
        raise ValueError(f"group_size: {group_size} is neither -1 nor a positive multiple of {MIN_BLOCK_K}")
    groups = 1 if group_size == -1 else cdiv(k, group_size)
    check_tensor("scales", scales, 2, (torch.float32,))
    if tuple(scales.shape) != (groups, n):
        raise ValueError(f"scales: {tuple(scales.shape)}, expected [{groups}, {n}] (groups of {group_size})")
    if zeros is not None and (zeros.dtype != torch.float32 or zeros.shape != scales.shape):
        raise ValueError(f"zeros: {zeros.dtype} {tuple(zeros.shape)}, expected float32 {tuple(scales.shape)}")


def dequant_gemm(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor | None,
                 bits: int, group_size: int, bias: torch.Tensor | None = None) -> torch.Tensor:
    """As `reference.dequant_gemm`: `x [M, K]` times the packed weight (module docstring) `(+ bias [N])`
    -> `[M, N]` in x's dtype."""
    check_tensor("x", x, 2, ACTIVATION_DTYPES)
    m, k = x.shape
    check_weight(qweight, scales, zeros, bits, group_size, k)
    n = qweight.shape[1]
    tensors = {"x": x, "qweight": qweight, "scales": scales}
    if zeros is not None:
        tensors["zeros"] = zeros
    if bias is not None:
        if bias.shape != (n,):
            raise ValueError(f"bias: {tuple(bias.shape)}, expected [{n}]")
        tensors["bias"] = bias
    check_same_device(**tensors)
    y = torch.empty(m, n, dtype=x.dtype, device=x.device)
    if m == 0 or n == 0:
        return y
    if k == 0:
        return y.zero_() if bias is None else y.copy_(bias.expand(m, n))
    if x.stride(1) != 1:
        x = x.contiguous()
    qweight, scales = qweight.contiguous(), scales.contiguous()
    zeros = zeros.contiguous() if zeros is not None else None
    block_m, block_n, block_k = block_config(m, group_size)
    grid = (cdiv(m, block_m), cdiv(n, block_n))
    launchable(_dequant_gemm_kernel, x.device)[grid](
        x, qweight, scales, zeros if zeros is not None else scales, bias if bias is not None else scales, y,
        m, n, k, k if group_size == -1 else group_size, x.stride(0), qweight.stride(0), scales.stride(0), y.stride(0),
        BITS=bits, PER=32 // bits, MASK=2**bits - 1, SYM_ZERO=float(2 ** (bits - 1)), HAS_ZEROS=zeros is not None, HAS_BIAS=bias is not None,
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, PRECISION=dot_precision(x.dtype),
    )
    return y
