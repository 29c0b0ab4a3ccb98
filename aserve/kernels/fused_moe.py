"""Fused mixture-of-experts MLP (vLLM's fused_moe shape): a grouped GEMM over the token-expert pairs
sorted by expert. The torch reference is `reference.fused_moe`.

`moe_align_block_size` sorts the `T * k` pairs by expert and pads each expert's run to a multiple of
BLOCK_M (padding entries hold the sentinel `T * k`), so each BLOCK_M-row block of the sorted list
belongs to one expert (`expert_ids[block]`). `_fused_moe_kernel` runs one program per (block of sorted
pairs, tile of output columns): it gathers the block's input rows (row `pair // TOP_K`), multiplies
them by that expert's weight tile by tile along K in fp32, optionally scales each row by its pair's
routing weight, and stores the rows at their pair index. `fused_experts` chains gate|up -> SiLU-and-mul
-> down and sums each token's k rows.

No host syncs: the buffers are sized for the worst case (every active expert's run padded) and
programs past the padded total return at once, so the whole op can be captured in a CUDA graph.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .activation import silu_and_mul
from .triton_utils import ACTIVATION_DTYPES, cdiv, check_same_device, check_tensor, dot_precision, launchable


@triton.jit
def _fused_moe_kernel(
    a_ptr,  # [rows, K]: the tokens' hidden states (TOP_K = k) or the pairs' activations (TOP_K = 1)
    b_ptr,  # [E, N, K]: the experts' weights
    c_ptr,  # [num_pairs, N]: one output row per pair
    weights_ptr,  # [num_pairs] float32 routing weights (read only if MUL_WEIGHT)
    sorted_ids_ptr,  # [capacity] int32 pair indices grouped by expert; num_pairs = padding
    expert_ids_ptr,  # [capacity / BLOCK_M] int32 expert of each block
    num_padded_ptr,  # [1] the padded total: blocks from here on are empty
    N,
    K,
    num_pairs,
    stride_am,
    stride_be,
    stride_bn,
    stride_cm,
    TOP_K: tl.constexpr,
    MUL_WEIGHT: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    PRECISION: tl.constexpr,
):
    pid = tl.program_id(0)
    num_n_tiles = (N + BLOCK_N - 1) // BLOCK_N
    pid_m = pid // num_n_tiles
    pid_n = pid % num_n_tiles
    if pid_m * BLOCK_M >= tl.load(num_padded_ptr):
        return
    pair = tl.load(sorted_ids_ptr + pid_m * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)
    valid = pair < num_pairs
    expert = tl.load(expert_ids_ptr + pid_m).to(tl.int64)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    col_mask = cols < N
    offs_k = tl.arange(0, BLOCK_K)
    a_rows = a_ptr + (pair // TOP_K)[:, None] * stride_am
    b_cols = b_ptr + expert * stride_be + cols[None, :] * stride_bn
    acc = tl.full([BLOCK_M, BLOCK_N], 0.0, tl.float32)
    for k0 in range(0, K, BLOCK_K):
        ks = k0 + offs_k
        k_mask = ks < K
        a = tl.load(a_rows + ks[None, :], mask=valid[:, None] & k_mask[None, :], other=0.0)
        b = tl.load(b_cols + ks[:, None], mask=k_mask[:, None] & col_mask[None, :], other=0.0)
        acc += tl.dot(a, b, input_precision=PRECISION)
    if MUL_WEIGHT:
        w = tl.load(weights_ptr + pair, mask=valid, other=0.0).to(tl.float32)
        acc = acc * w[:, None]
    tl.store(c_ptr + pair[:, None] * stride_cm + cols[None, :], acc.to(c_ptr.dtype.element_ty),
             mask=valid[:, None] & col_mask[None, :])


def block_config(num_pairs: int, num_experts: int) -> tuple[int, int, int]:
    """(BLOCK_M, BLOCK_N, BLOCK_K): small row blocks when experts get few pairs each (decode), where
    padding every expert's run to BLOCK_M would waste most of each block."""
    if num_pairs <= num_experts * 4:
        return 16, 32, 64
    return 64, 64, 32


def moe_align_block_size(topk_ids: torch.Tensor, num_experts: int,
                         block_m: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """`(sorted_ids, expert_ids, num_padded)` for `topk_ids [T, k]` (see the module docstring):
    `sorted_ids [capacity]` int32, each expert's pairs (token order kept) padded with `T * k` to a
    multiple of `block_m`; `expert_ids [capacity / block_m]` int32; `num_padded [1]` the padded
    total. `capacity` depends on the shapes only (no host sync)."""
    flat = topk_ids.reshape(-1).to(torch.int64)
    num_pairs, device = flat.numel(), flat.device
    sorted_experts, order = torch.sort(flat, stable=True)
    counts = torch.zeros(num_experts, dtype=torch.int64, device=device).scatter_add_(0, flat, torch.ones_like(flat))
    padded = (counts + block_m - 1) // block_m * block_m
    padded_end = padded.cumsum(0)
    run_start = counts.cumsum(0) - counts
    rank = torch.arange(num_pairs, device=device) - run_start[sorted_experts]
    dest = (padded_end - padded)[sorted_experts] + rank
    capacity = cdiv(num_pairs + min(num_experts, num_pairs) * (block_m - 1), block_m) * block_m
    sorted_ids = torch.full((capacity,), num_pairs, dtype=torch.int32, device=device)
    sorted_ids.scatter_(0, dest, order.to(torch.int32))
    block_starts = torch.arange(0, capacity, block_m, device=device)
    expert_ids = torch.searchsorted(padded_end, block_starts, right=True).clamp_(max=num_experts - 1)
    return sorted_ids, expert_ids.to(torch.int32), padded_end[-1:]


def _grouped_matmul(a: torch.Tensor, b: torch.Tensor, out: torch.Tensor, weights: torch.Tensor | None,
                    align: tuple[torch.Tensor, torch.Tensor, torch.Tensor], top_k: int,
                    blocks: tuple[int, int, int]) -> None:
    sorted_ids, expert_ids, num_padded = align
    block_m, block_n, block_k = blocks
    n, k = b.shape[1], b.shape[2]
    grid = (expert_ids.numel() * cdiv(n, block_n),)
    launchable(_fused_moe_kernel, a.device)[grid](
        a, b, out, weights if weights is not None else out, sorted_ids, expert_ids, num_padded,
        n, k, out.shape[0], a.stride(0), b.stride(0), b.stride(1), out.stride(0),
        TOP_K=top_k, MUL_WEIGHT=weights is not None, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k,
        PRECISION=dot_precision(a.dtype),
    )


def fused_experts(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor,
                  topk_ids: torch.Tensor) -> torch.Tensor:
    """As `reference.fused_moe`: x `[T, H]`, `w13 [E, 2I, H]` (gate rows, then up), `w2 [E, H, I]`,
    `topk_weights [T, k]`, `topk_ids [T, k]` (int, each in [0, E)) -> `[T, H]` in x's dtype (each
    pair's row rounded to it, then summed per token in fp32)."""
    check_tensor("x", x, 2, ACTIVATION_DTYPES)
    check_tensor("w13", w13, 3, (x.dtype,))
    check_tensor("w2", w2, 3, (x.dtype,))
    check_tensor("topk_ids", topk_ids, 2)
    check_same_device(x=x, w13=w13, w2=w2, topk_weights=topk_weights, topk_ids=topk_ids)
    num_tokens, hidden = x.shape
    num_experts, two_i, _ = w13.shape
    if w13.shape[2] != hidden or w2.shape != (num_experts, hidden, two_i // 2) or two_i % 2:
        raise ValueError(f"w13 {tuple(w13.shape)} / w2 {tuple(w2.shape)} do not fit x {tuple(x.shape)}: "
                         "expected [E, 2I, H] and [E, H, I]")
    if topk_weights.shape != topk_ids.shape or topk_ids.shape[0] != num_tokens:
        raise ValueError(f"topk_weights {tuple(topk_weights.shape)} / topk_ids {tuple(topk_ids.shape)}: "
                         f"expected [{num_tokens}, k] both")
    top_k = topk_ids.shape[1]
    if num_tokens == 0:
        return x.new_zeros(x.shape)
    x, w13, w2 = x.contiguous(), w13.contiguous(), w2.contiguous()
    blocks = block_config(num_tokens * top_k, num_experts)
    align = moe_align_block_size(topk_ids, num_experts, blocks[0])
    gate_up = torch.empty((num_tokens * top_k, two_i), dtype=x.dtype, device=x.device)
    _grouped_matmul(x, w13, gate_up, None, align, top_k, blocks)
    act = silu_and_mul(gate_up)
    out = torch.empty((num_tokens * top_k, hidden), dtype=x.dtype, device=x.device)
    weights = topk_weights.reshape(-1).to(torch.float32).contiguous()
    _grouped_matmul(act, w2, out, weights, align, 1, blocks)
    return out.view(num_tokens, top_k, hidden).sum(1, dtype=torch.float32).to(x.dtype)
