"""Fused SwiGLU gate: `silu(x[:, :N]) * x[:, N:]`, computed in fp32 and rounded once."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .triton_utils import ACTIVATION_DTYPES, cdiv, check_tensor, launchable, next_power_of_2


@triton.jit
def _silu_and_mul_kernel(
    x_ptr,  # [T, 2N]
    out_ptr,  # [T, N]
    stride_x,
    stride_o,
    N,
    BLOCK: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < N
    gate = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(x_ptr + row * stride_x + N + cols, mask=mask, other=0.0).to(tl.float32)
    # sigmoid from exp(-|gate|) never overflows
    e = tl.exp(-tl.abs(gate))
    sigmoid = tl.where(gate >= 0, 1.0 / (1.0 + e), e / (1.0 + e))
    silu = gate * sigmoid
    tl.store(out_ptr + row * stride_o + cols, (silu * up).to(out_ptr.dtype.element_ty), mask=mask)


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """x [..., 2N] -> silu(x[..., :N]) * x[..., N:] as a new [..., N] tensor in x's dtype."""
    if not isinstance(x, torch.Tensor) or x.dim() < 1:
        raise ValueError("x: expected a tensor with at least 1 dim")
    check_tensor("x", x, x.dim(), ACTIVATION_DTYPES)
    if x.shape[-1] % 2:
        raise ValueError(f"x: last dim must be even (gate and up halves), got {x.shape[-1]}")
    half = x.shape[-1] // 2
    x2 = x.reshape(-1, x.shape[-1])
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    out = torch.empty((x2.shape[0], half), dtype=x.dtype, device=x.device)
    if x2.shape[0] > 0 and half > 0:
        block = min(1024, next_power_of_2(half))
        launchable(_silu_and_mul_kernel, x.device)[(x2.shape[0], cdiv(half, block))](
            x2, out, x2.stride(0), out.stride(0), half, BLOCK=block
        )
    return out.view(*x.shape[:-1], half)
