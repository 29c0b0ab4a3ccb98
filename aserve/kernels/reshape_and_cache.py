"""Write this step's keys and values into the paged KV cache at their slots.

One program per token copies all its KV heads (a `[KVH_PAD, HEAD_DIM_PAD]` tile) for keys and
values; slot -1 (padding) is skipped. An fp8 cache (e4m3 or e5m2) stores `x / scale` rounded to
its dtype, computed in fp32 with IEEE division; e4m3 saturates at +-448 like torch's conversion.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .triton_utils import (
    ACTIVATION_DTYPES,
    FP8_DTYPES,
    FP8_E4M3_MAX,
    check_same_device,
    check_scale,
    check_tensor,
    launchable,
    next_power_of_2,
)


@triton.jit
def _reshape_and_cache_kernel(
    key_ptr,  # [T, KVH, D]
    value_ptr,
    k_cache_ptr,  # [num_blocks, BLOCK_SIZE, KVH, D]
    v_cache_ptr,
    slot_mapping_ptr,  # [T] int32/int64, -1 = skip
    k_scale,
    v_scale,
    stride_kt,
    stride_kh,
    stride_vt,
    stride_vh,
    stride_kcb,
    stride_kct,
    stride_kch,
    stride_vcb,
    stride_vct,
    stride_vch,
    NUM_KV_HEADS: tl.constexpr,
    KV_HEADS_PAD: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    HEAD_DIM_PAD: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    QUANTIZE: tl.constexpr,
    CLAMP: tl.constexpr,  # saturate to +-CLAMP before the fp8 cast; 0 = no clamp
):
    token = tl.program_id(0)
    slot = tl.load(slot_mapping_ptr + token).to(tl.int64)
    if slot < 0:
        return
    block = slot // BLOCK_SIZE
    offset = slot % BLOCK_SIZE
    heads = tl.arange(0, KV_HEADS_PAD)
    dims = tl.arange(0, HEAD_DIM_PAD)
    mask = (heads < NUM_KV_HEADS)[:, None] & (dims < HEAD_DIM)[None, :]

    k = tl.load(key_ptr + token * stride_kt + heads[:, None] * stride_kh + dims[None, :], mask=mask)
    v = tl.load(value_ptr + token * stride_vt + heads[:, None] * stride_vh + dims[None, :], mask=mask)
    if QUANTIZE:
        k = tl.math.div_rn(k.to(tl.float32), k_scale)
        v = tl.math.div_rn(v.to(tl.float32), v_scale)
        if CLAMP > 0:
            k = tl.minimum(tl.maximum(k, -CLAMP), CLAMP)
            v = tl.minimum(tl.maximum(v, -CLAMP), CLAMP)
    k_dst = (
        k_cache_ptr + block * stride_kcb + offset * stride_kct + heads[:, None] * stride_kch + dims[None, :]
    )
    v_dst = (
        v_cache_ptr + block * stride_vcb + offset * stride_vct + heads[:, None] * stride_vch + dims[None, :]
    )
    tl.store(k_dst, k.to(k_cache_ptr.dtype.element_ty), mask=mask)
    tl.store(v_dst, v.to(v_cache_ptr.dtype.element_ty), mask=mask)


def reshape_and_cache(
    key: torch.Tensor,
    value: torch.Tensor,
    kv_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
) -> None:
    """Write key/value [T, KVH, D] into kv_cache [2, num_blocks, block_size, KVH, D] in place.

    slot_mapping [T] int64 (or int32): slot = block * block_size + offset; -1 skips the token.
    Slots must be distinct. An fp8 cache stores (x / scale) in its dtype; scales other than
    1.0 are rejected for an unquantized cache.
    """
    check_tensor("key", key, 3, ACTIVATION_DTYPES)
    check_tensor("value", value, 3, ACTIVATION_DTYPES)
    check_tensor("kv_cache", kv_cache, 5, ACTIVATION_DTYPES + FP8_DTYPES)
    check_tensor("slot_mapping", slot_mapping, 1, (torch.int64, torch.int32))
    device = check_same_device(key=key, value=value, kv_cache=kv_cache, slot_mapping=slot_mapping)
    _, _, block_size, num_kv_heads, head_dim = kv_cache.shape
    if kv_cache.shape[0] != 2:
        raise ValueError(f"kv_cache: dim 0 must be 2 (keys, values), got shape {tuple(kv_cache.shape)}")
    num_tokens = key.shape[0]
    if key.shape != (num_tokens, num_kv_heads, head_dim):
        raise ValueError(
            f"key: expected [T, {num_kv_heads}, {head_dim}] to match kv_cache, got {tuple(key.shape)}"
        )
    if value.shape != key.shape:
        raise ValueError(f"value: shape {tuple(value.shape)} != key shape {tuple(key.shape)}")
    if slot_mapping.shape[0] != num_tokens:
        raise ValueError(f"slot_mapping: expected {num_tokens} entries like key, got {slot_mapping.shape[0]}")
    if key.stride(2) != 1 or value.stride(2) != 1 or kv_cache.stride(4) != 1:
        raise ValueError("key, value and kv_cache must be contiguous in their last dim")
    quantized = kv_cache.dtype in FP8_DTYPES
    k_scale = check_scale("k_scale", k_scale, quantized)
    v_scale = check_scale("v_scale", v_scale, quantized)
    if num_tokens == 0:
        return

    k_cache, v_cache = kv_cache[0], kv_cache[1]
    launchable(_reshape_and_cache_kernel, device)[(num_tokens,)](
        key, value, k_cache, v_cache, slot_mapping, k_scale, v_scale,
        key.stride(0), key.stride(1), value.stride(0), value.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        NUM_KV_HEADS=num_kv_heads, KV_HEADS_PAD=next_power_of_2(num_kv_heads),
        HEAD_DIM=head_dim, HEAD_DIM_PAD=next_power_of_2(head_dim), BLOCK_SIZE=block_size,
        QUANTIZE=quantized, CLAMP=FP8_E4M3_MAX if kv_cache.dtype == torch.float8_e4m3fn else 0.0,
    )  # fmt: skip
