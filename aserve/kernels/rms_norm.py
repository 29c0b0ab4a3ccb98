"""RMSNorm over the last dim, optionally fused with the residual add that precedes it.

One program per row: `out = weight * (x * rsqrt(mean(x^2) + eps))`, the normalization computed
in fp32 and rounded to x's dtype before the weight multiply (the reference's order). With a
residual, `s = x + residual` is rounded to x's dtype, returned, and normalized.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .triton_utils import (
    ACTIVATION_DTYPES,
    SUM_COMBINE,
    check_same_device,
    check_tensor,
    launchable,
    next_power_of_2,
)


@triton.jit
def _rms_norm_kernel(
    x_ptr,  # [T, N]
    residual_ptr,  # [T, N]; unused unless HAS_RESIDUAL
    weight_ptr,  # [N]
    out_ptr,  # [T, N]
    sum_ptr,  # [T, N] x + residual; unused unless HAS_RESIDUAL
    eps,
    stride_x,
    stride_r,
    stride_o,
    stride_s,
    N: tl.constexpr,
    BLOCK_N: tl.constexpr,
    HAS_RESIDUAL: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK_N)
    mask = cols < N
    x = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0)
    if HAS_RESIDUAL:
        r = tl.load(residual_ptr + row * stride_r + cols, mask=mask, other=0.0)
        x = (x.to(tl.float32) + r.to(tl.float32)).to(x_ptr.dtype.element_ty)
        tl.store(sum_ptr + row * stride_s + cols, x, mask=mask)
    x32 = x.to(tl.float32)
    inv_rms = tl.math.rsqrt(tl.reduce(x32 * x32, 0, SUM_COMBINE) / N + eps)
    normed = (x32 * inv_rms).to(x_ptr.dtype.element_ty).to(tl.float32)
    w = tl.load(weight_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + row * stride_o + cols, (normed * w).to(out_ptr.dtype.element_ty), mask=mask)


def rms_norm(
    x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """RMSNorm of x [..., N] with weight [N]; returns a new tensor in x's dtype.

    With `residual` (x's shape and dtype): returns `(rms_norm(x + residual), x + residual)`.
    """
    if not isinstance(x, torch.Tensor) or x.dim() < 1:
        raise ValueError("x: expected a tensor with at least 1 dim")
    check_tensor("x", x, x.dim(), ACTIVATION_DTYPES)
    check_tensor("weight", weight, 1, ACTIVATION_DTYPES)
    hidden = x.shape[-1]
    if weight.shape[0] != hidden:
        raise ValueError(f"weight: expected [{hidden}] to match x's last dim, got {tuple(weight.shape)}")
    if residual is not None:
        check_tensor("residual", residual, x.dim(), (x.dtype,))
        if residual.shape != x.shape:
            raise ValueError(f"residual: shape {tuple(residual.shape)} != x shape {tuple(x.shape)}")
        device = check_same_device(x=x, weight=weight, residual=residual)
    else:
        device = check_same_device(x=x, weight=weight)
    if not eps >= 0.0:
        raise ValueError(f"eps: must be >= 0, got {eps}")

    x2 = x.reshape(-1, hidden)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    out = torch.empty(x2.shape, dtype=x.dtype, device=device)
    if residual is not None:
        r2 = residual.reshape(-1, hidden)
        if r2.stride(-1) != 1:
            r2 = r2.contiguous()
        summed = torch.empty_like(out)
    else:
        r2, summed = x2, out
    if x2.shape[0] > 0:
        launchable(_rms_norm_kernel, device)[(x2.shape[0],)](
            x2, r2, weight.contiguous(), out, summed, float(eps),
            x2.stride(0), r2.stride(0), out.stride(0), summed.stride(0),
            N=hidden, BLOCK_N=next_power_of_2(hidden), HAS_RESIDUAL=residual is not None,
        )  # fmt: skip
    out = out.view(x.shape)
    if residual is not None:
        return out, summed.view(x.shape)
    return out
