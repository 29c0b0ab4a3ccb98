"""Multi-LoRA deltas: `y[t] += B[s] @ (A[s] @ x[t])` (+ `bias[s]`) for each token t with slot s = its
adapter's slot (-1: base model, nothing added). Scaling is folded into B (and bias) at load.

Layout of one layer's stacked LoRA weights (S = max_loras slots, R = max_rank, n = num_shards, the
parts of a fused layer, e.g. q|k|v):
  lora_a  `[S, R * n, K]`, rank-major: row `j * n + i` is rank j of shard i's A, so a slot's first
          r ranks of every shard are the contiguous rows `[: r * n]`;
  lora_b  `[S, out, R]`: output rows of shard i (`output_slices[i]` rows, in order) use shard i's B;
  lora_bias `[S, out]` (optional); rows past a shard's rank are zero.

CPU with bf16 LoRA weights: one C call per layer (`lora_cpu.py`, `lora_cpu.c`). The torch forms here
are the CPU fallback (float32 / float16 LoRA weights, no C compiler, torch.compile): `lora_delta_dense`
for small steps (every slot at once, masked) and `lora_delta_cpu`, tokens grouped by slot (`perm`,
`segments` of the step's mapping): per active slot one shrink matmul over all the slot's tokens and
one expand matmul per output slice, sliced to the slot's actual rank. CUDA (`lora_shrink`, `lora_expand`): BGMV-style Triton kernels, one program
per (token, tile of rows), each reading its token's slot from `token_slots` on the device: no host
sync and no data-dependent launch, so a CUDA graph can capture them and replay over new slots. Both
accumulate in fp32. The torch references are `ref_lora_shrink` / `ref_lora_expand`.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

import torch

try:  # the CPU path needs no triton (the model imports this module on every platform)
    import triton
    import triton.language as tl

    from .triton_utils import SUM_COMBINE, cdiv, check_same_device, check_tensor, launchable, next_power_of_2

    HAVE_TRITON = True
except ImportError:  # pragma: no cover - platforms without triton
    HAVE_TRITON = False

FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


class SlotGroups(Protocol):
    """What `lora_delta_cpu` reads of a step's mapping (aserve.model.lora.mapping.LoRABatchMapping)."""

    perm: torch.Tensor
    segments: Sequence[tuple[int, int, int]]
    num_tokens: int


def _offsets(output_slices: Sequence[int]) -> list[int]:
    return [sum(output_slices[:i]) for i in range(len(output_slices))]


# -- CPU: grouped by slot ----------------------------------------------------------------------------
def lora_delta_cpu(x: torch.Tensor, mapping: SlotGroups, lora_a: torch.Tensor, lora_b: torch.Tensor,
                   ranks: Sequence[int], output_slices: Sequence[int], lora_bias: torch.Tensor | None = None,
                   y: torch.Tensor | None = None) -> torch.Tensor:
    """The LoRA delta of `x [T, K]` for the tokens of `mapping` (see the module docstring for the
    weight layout; `ranks[s]` is slot s's rank, 0 = no adapter on this layer: skipped, bias included). Computed in lora_a's
    dtype. With `y [T, out]`: added into y in y's dtype (in place) and y returned; else the delta
    `[T, out]` (zero rows for base tokens) in lora_a's dtype."""
    num_tokens, num_shards = x.shape[0], len(output_slices)
    dtype = lora_a.dtype
    offsets = _offsets(output_slices)
    result = y if y is not None else torch.zeros(num_tokens, sum(output_slices), dtype=dtype, device=x.device)
    for slot, start, end in mapping.segments:
        rank = ranks[slot]
        if rank == 0:  # the slot's adapter does not target this layer
            continue
        whole = end - start == num_tokens  # one adapter for the whole batch: no gather, no scatter
        idx = None if whole else mapping.perm[start:end]
        xs = (x if whole else x.index_select(0, idx)).to(dtype)
        shrunk = xs @ lora_a[slot, : rank * num_shards].T  # [n, rank * num_shards], rank-major
        b = lora_b[slot, :, :rank]
        if num_shards == 1:
            delta = shrunk @ b.T
        else:
            delta = torch.cat([shrunk[:, i::num_shards] @ b[off:off + size].T
                               for i, (off, size) in enumerate(zip(offsets, output_slices, strict=True))], 1)
        if lora_bias is not None:
            delta = delta.add_(lora_bias[slot])
        if whole:
            result.add_(delta.to(result.dtype))
        else:
            result.index_add_(0, idx, delta.to(result.dtype))
    return result


# -- CPU: dense over every slot (small steps) -----------------------------------------------------------
def lora_delta_dense(x: torch.Tensor, column_mask: torch.Tensor, lora_a: torch.Tensor, lora_b_dense: torch.Tensor,
                     y: torch.Tensor, slot_mask: torch.Tensor | None = None,
                     lora_bias: torch.Tensor | None = None) -> torch.Tensor:
    """Adds the LoRA delta of `x [T, K]` into `y [T, out]` (in place, returned) with one shrink over
    every slot at once, a mask and one expand: for decode-sized steps this is a handful of ops per
    layer instead of a few per active adapter. `lora_a [S, W, K]` (W = max_rank * num_shards, the
    layout above); `column_mask [T, S * W]` is 1 where the column's slot is the token's; `lora_b_dense
    [out, S * W]` holds each slot's B block-diagonally (shard i's rows in its own rank columns, zero
    elsewhere; when y has B's dtype the expand is fused into y); with `lora_bias [S, out]`, `slot_mask
    [T, S]` (1 at the token's slot) adds it."""
    dtype = lora_a.dtype
    shrunk = (x.to(dtype) @ lora_a.view(-1, lora_a.shape[-1]).T).mul_(column_mask)
    if lora_bias is not None:
        shrunk_bias = slot_mask.to(lora_bias.dtype) @ lora_bias
        y.add_(shrunk_bias.to(y.dtype))
    if y.dtype == lora_b_dense.dtype:
        return y.addmm_(shrunk, lora_b_dense.T)
    return y.add_((shrunk @ lora_b_dense.T).to(y.dtype))


# -- CUDA: per-token slot, Triton ---------------------------------------------------------------------
if HAVE_TRITON:
    @triton.jit
    def _lora_shrink_kernel(
        x_ptr,  # [T, K]
        a_ptr,  # [S, N, K]
        slots_ptr,  # [T] int32, -1 = no adapter
        out_ptr,  # [T, N] float32
        N,
        K,
        stride_x,
        stride_as,
        stride_an,
        stride_o,
        BLOCK_N: tl.constexpr,
        BLOCK_K: tl.constexpr,
    ):
        tok = tl.program_id(0).to(tl.int64)
        rows = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
        row_mask = rows < N
        slot = tl.load(slots_ptr + tok).to(tl.int64)
        acc = tl.full([BLOCK_N], 0.0, tl.float32)
        if slot >= 0:
            for k0 in range(0, K, BLOCK_K):
                ks = k0 + tl.arange(0, BLOCK_K)
                k_mask = ks < K
                xv = tl.load(x_ptr + tok * stride_x + ks, mask=k_mask, other=0.0).to(tl.float32)
                a = tl.load(a_ptr + slot * stride_as + rows[:, None] * stride_an + ks[None, :],
                            mask=row_mask[:, None] & k_mask[None, :], other=0.0).to(tl.float32)
                acc += tl.reduce(a * xv[None, :], 1, SUM_COMBINE)
        tl.store(out_ptr + tok * stride_o + rows, acc, mask=row_mask)


    @triton.jit
    def _lora_expand_kernel(
        s_ptr,  # [T, R * NUM_SHARDS] float32 (rank-major)
        b_ptr,  # [S, OUT, R]
        bias_ptr,  # [S, OUT]; read only if HAS_BIAS
        slots_ptr,  # [T] int32
        y_ptr,  # [T, OUT], updated in place
        n_out,  # rows of this shard
        R,
        shard,
        num_shards,
        out_offset,
        stride_s,
        stride_bs,
        stride_bn,
        stride_bias,
        stride_y,
        HAS_BIAS: tl.constexpr,
        BLOCK_N: tl.constexpr,
        BLOCK_R: tl.constexpr,
    ):
        tok = tl.program_id(0).to(tl.int64)
        slot = tl.load(slots_ptr + tok).to(tl.int64)
        if slot >= 0:
            rows = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
            row_mask = rows < n_out
            rs = tl.arange(0, BLOCK_R)
            r_mask = rs < R
            sv = tl.load(s_ptr + tok * stride_s + rs * num_shards + shard, mask=r_mask, other=0.0).to(tl.float32)
            b = tl.load(b_ptr + slot * stride_bs + (out_offset + rows)[:, None] * stride_bn + rs[None, :],
                        mask=row_mask[:, None] & r_mask[None, :], other=0.0).to(tl.float32)
            acc = tl.reduce(b * sv[None, :], 1, SUM_COMBINE)
            if HAS_BIAS:
                acc += tl.load(bias_ptr + slot * stride_bias + out_offset + rows, mask=row_mask, other=0.0).to(tl.float32)
            y_rows = y_ptr + tok * stride_y + out_offset + rows
            yv = tl.load(y_rows, mask=row_mask, other=0.0).to(tl.float32)
            tl.store(y_rows, (yv + acc).to(y_ptr.dtype.element_ty), mask=row_mask)


def _need_triton() -> None:
    if not HAVE_TRITON:
        raise RuntimeError("the LoRA CUDA kernels need triton, which is not installed")


def lora_shrink(x: torch.Tensor, lora_a: torch.Tensor, token_slots: torch.Tensor) -> torch.Tensor:
    """`out [T, N]` float32 with `out[t] = lora_a[slot[t]] @ x[t]` (zeros where slot is -1), for
    `x [T, K]`, `lora_a [S, N, K]`, `token_slots [T]` int32 on x's device. Needs triton."""
    _need_triton()
    check_tensor("x", x, 2, FLOAT_DTYPES)
    check_tensor("lora_a", lora_a, 3, FLOAT_DTYPES)
    check_tensor("token_slots", token_slots, 1, (torch.int32,))
    device = check_same_device(x=x, lora_a=lora_a, token_slots=token_slots)
    num_tokens, k = x.shape
    if lora_a.shape[2] != k or token_slots.shape[0] != num_tokens:
        raise ValueError(f"lora_a {tuple(lora_a.shape)} / token_slots {tuple(token_slots.shape)} do not fit "
                         f"x {tuple(x.shape)}: expected [S, N, {k}] and [{num_tokens}]")
    n = lora_a.shape[1]
    out = torch.empty(num_tokens, n, dtype=torch.float32, device=device)
    if num_tokens == 0 or n == 0:
        return out.zero_()
    x = x if x.stride(1) == 1 else x.contiguous()
    lora_a = lora_a.contiguous()
    block_n = min(next_power_of_2(n), 32)
    block_k = min(next_power_of_2(k), 128)
    launchable(_lora_shrink_kernel, device)[(num_tokens, cdiv(n, block_n))](
        x, lora_a, token_slots, out, n, k, x.stride(0), lora_a.stride(0), lora_a.stride(1), out.stride(0),
        BLOCK_N=block_n, BLOCK_K=block_k,
    )
    return out


def lora_expand(shrunk: torch.Tensor, lora_b: torch.Tensor, token_slots: torch.Tensor, y: torch.Tensor,
                output_slices: Sequence[int], lora_bias: torch.Tensor | None = None) -> torch.Tensor:
    """Add `lora_b[slot[t]] @ shrunk[t]` (+ `lora_bias[slot[t]]`) into `y [T, out]` in place (y's
    dtype, fp32 accumulation), shard by shard (`output_slices`, see the module docstring); tokens of
    slot -1 keep their row. `shrunk [T, R * n]` as `lora_shrink` returns it. Returns y. Needs triton."""
    _need_triton()
    check_tensor("shrunk", shrunk, 2, FLOAT_DTYPES)
    check_tensor("lora_b", lora_b, 3, FLOAT_DTYPES)
    check_tensor("y", y, 2, FLOAT_DTYPES)
    check_tensor("token_slots", token_slots, 1, (torch.int32,))
    device = check_same_device(shrunk=shrunk, lora_b=lora_b, y=y, token_slots=token_slots)
    num_tokens, out_size = y.shape
    num_shards, rank = len(output_slices), lora_b.shape[2]
    if (lora_b.shape[1] != out_size or sum(output_slices) != out_size or shrunk.shape != (num_tokens, rank * num_shards)
            or token_slots.shape[0] != num_tokens):
        raise ValueError(f"shrunk {tuple(shrunk.shape)} / lora_b {tuple(lora_b.shape)} / slices {list(output_slices)} "
                         f"do not fit y {tuple(y.shape)}")
    if lora_bias is not None:
        check_tensor("lora_bias", lora_bias, 2, FLOAT_DTYPES)
        if lora_bias.shape != (lora_b.shape[0], out_size):
            raise ValueError(f"lora_bias: expected {(lora_b.shape[0], out_size)}, got {tuple(lora_bias.shape)}")
    if y.stride(1) != 1:
        raise ValueError("y: rows must have unit stride (updated in place)")
    if num_tokens == 0 or rank == 0:
        return y
    shrunk, lora_b = shrunk.contiguous(), lora_b.contiguous()
    bias = lora_bias.contiguous() if lora_bias is not None else lora_b
    block_r = next_power_of_2(rank)
    kernel = launchable(_lora_expand_kernel, device)
    for shard, (offset, size) in enumerate(zip(_offsets(output_slices), output_slices, strict=True)):
        block_n = min(next_power_of_2(size), 64)
        kernel[(num_tokens, cdiv(size, block_n))](
            shrunk, lora_b, bias, token_slots, y, size, rank, shard, num_shards, offset,
            shrunk.stride(0), lora_b.stride(0), lora_b.stride(1), bias.stride(0), y.stride(0),
            HAS_BIAS=lora_bias is not None, BLOCK_N=block_n, BLOCK_R=block_r,
        )
    return y


# -- torch references ---------------------------------------------------------------------------------
def ref_lora_shrink(x: torch.Tensor, lora_a: torch.Tensor, token_slots: torch.Tensor) -> torch.Tensor:
    """`lora_shrink` in torch (fp32): `[T, N]`, zero rows for slot -1."""
    slots = token_slots.long()
    a = lora_a[slots.clamp(min=0)].float()
    return torch.einsum("tnk,tk->tn", a, x.float()) * (slots >= 0).unsqueeze(1)


def ref_lora_expand(shrunk: torch.Tensor, lora_b: torch.Tensor, token_slots: torch.Tensor, y: torch.Tensor,
                    output_slices: Sequence[int], lora_bias: torch.Tensor | None = None) -> torch.Tensor:
    """`lora_expand` in torch: a new tensor (y is not modified), fp32 math, y's dtype."""
    slots = token_slots.long()
    num_shards = len(output_slices)
    b = lora_b[slots.clamp(min=0)].float()  # [T, out, R]
    s = shrunk.float().view(shrunk.shape[0], lora_b.shape[2], num_shards)
    parts = [torch.einsum("tor,tr->to", b[:, off:off + size], s[:, :, i])
             for i, (off, size) in enumerate(zip(_offsets(output_slices), output_slices, strict=True))]
    delta = torch.cat(parts, 1) if parts else torch.zeros_like(y, dtype=torch.float32)
    if lora_bias is not None:
        delta = delta + lora_bias[slots.clamp(min=0)].float()
    return (y.float() + delta * (slots >= 0).unsqueeze(1)).to(y.dtype)
