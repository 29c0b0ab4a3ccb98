"""Rotary position embedding for q and k, neox (rotate halves) or GPT-J (rotate pairs) style.

`cos_sin_cache` `[max_pos, rot_dim]` holds `cat(cos, sin)` per position, so every scaling variant
(linear, dynamic NTK, YaRN, llama3) is folded into the cache and this one kernel covers them.
One program per token rotates the first `rot_dim` dims of every head (one launch for q, one
for k), copies the rest, and writes new tensors. cos/sin are rounded to the activations' dtype
first (the reference's order); the rotation itself runs in fp32 and is rounded once.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .triton_utils import ACTIVATION_DTYPES, check_same_device, check_tensor, launchable, next_power_of_2


@triton.jit
def _rotary_kernel(
    positions_ptr,  # [T]
    x_ptr,  # [T, NUM_HEADS, HEAD_DIM]
    cos_sin_ptr,  # [max_pos, 2 * HALF]
    out_ptr,  # [T, NUM_HEADS, HEAD_DIM]
    stride_xt,
    stride_xh,
    stride_cs,
    stride_ot,
    stride_oh,
    NUM_HEADS: tl.constexpr,
    HEADS_PAD: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    HALF: tl.constexpr,
    HALF_PAD: tl.constexpr,
    PASS_PAD: tl.constexpr,
    IS_NEOX: tl.constexpr,
):
    token = tl.program_id(0).to(tl.int64)
    pos = tl.load(positions_ptr + token).to(tl.int64)
    pairs = tl.arange(0, HALF_PAD)[None, :]
    row = cos_sin_ptr + pos * stride_cs
    act_ty = x_ptr.dtype.element_ty
    cos = tl.load(row + pairs, mask=pairs < HALF, other=0.0).to(act_ty).to(tl.float32)
    sin = tl.load(row + HALF + pairs, mask=pairs < HALF, other=0.0).to(act_ty).to(tl.float32)

    heads = tl.arange(0, HEADS_PAD)[:, None]
    mask = (heads < NUM_HEADS) & (pairs < HALF)
    if IS_NEOX:
        first = pairs
        second = pairs + HALF
    else:
        first = 2 * pairs
        second = 2 * pairs + 1
    src = x_ptr + token * stride_xt + heads * stride_xh
    dst = out_ptr + token * stride_ot + heads * stride_oh
    x1 = tl.load(src + first, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(src + second, mask=mask, other=0.0).to(tl.float32)
    tl.store(dst + first, (x1 * cos - x2 * sin).to(act_ty), mask=mask)
    tl.store(dst + second, (x2 * cos + x1 * sin).to(act_ty), mask=mask)
    if PASS_PAD > 0:
        rest = 2 * HALF + tl.arange(0, PASS_PAD)[None, :]
        rest_mask = (heads < NUM_HEADS) & (rest < HEAD_DIM)
        tl.store(dst + rest, tl.load(src + rest, mask=rest_mask), mask=rest_mask)


def rotary_embedding(
    positions: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    cos_sin_cache: torch.Tensor,
    is_neox: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotate the first rot_dim dims of q [T, H, D] and k [T, KVH, D] at positions [T] (int).

    cos_sin_cache [max_pos, rot_dim] = cat(cos, sin), rot_dim even and <= D; positions must be
    < max_pos (not checked on the device). Returns new (q, k) in the inputs' dtype.
    """
    check_tensor("positions", positions, 1, (torch.int64, torch.int32))
    check_tensor("q", q, 3, ACTIVATION_DTYPES)
    check_tensor("k", k, 3, (q.dtype,))
    check_tensor("cos_sin_cache", cos_sin_cache, 2, ACTIVATION_DTYPES)
    device = check_same_device(positions=positions, q=q, k=k, cos_sin_cache=cos_sin_cache)
    num_tokens, _, head_dim = q.shape
    rot_dim = cos_sin_cache.shape[1]
    if k.shape[0] != num_tokens or k.shape[2] != head_dim:
        raise ValueError(f"k: expected [{num_tokens}, KVH, {head_dim}] like q, got {tuple(k.shape)}")
    if positions.shape[0] != num_tokens:
        raise ValueError(f"positions: expected {num_tokens} entries like q, got {positions.shape[0]}")
    if rot_dim % 2 or not 0 < rot_dim <= head_dim:
        raise ValueError(f"cos_sin_cache: rot_dim {rot_dim} must be even and in (0, head_dim={head_dim}]")
    if q.stride(2) != 1 or k.stride(2) != 1 or cos_sin_cache.stride(1) != 1:
        raise ValueError("q, k and cos_sin_cache must be contiguous in their last dim")
    q_out = torch.empty(q.shape, dtype=q.dtype, device=device)
    k_out = torch.empty(k.shape, dtype=k.dtype, device=device)
    if num_tokens == 0:
        return q_out, k_out
    half = rot_dim // 2
    num_pass = head_dim - rot_dim
    kernel = launchable(_rotary_kernel, device)
    for x, out in ((q, q_out), (k, k_out)):
        kernel[(num_tokens,)](
            positions, x, cos_sin_cache, out,
            x.stride(0), x.stride(1), cos_sin_cache.stride(0), out.stride(0), out.stride(1),
            NUM_HEADS=x.shape[1], HEADS_PAD=next_power_of_2(x.shape[1]),
            HEAD_DIM=head_dim, HALF=half, HALF_PAD=next_power_of_2(half),
            PASS_PAD=next_power_of_2(num_pass) if num_pass else 0, IS_NEOX=bool(is_neox),
        )  # fmt: skip
    return q_out, k_out
