"""Paged decode attention: one query token per sequence against its paged KV context.

One program serves one (sequence, KV head[, context split]) and all the query heads that share
that KV head (GQA/MQA), packed into the rows of a `[GROUP_PAD, HEAD_DIM_PAD]` tile so the scores
are one `tl.dot` per tile of `TILE_N` context tokens. Tokens are gathered through the block table
one by one, so any block size works and a tile may span several blocks. Head sizes that are not
a power of two are padded with masks.

Long contexts use the split-context (flash-decoding) form: the context is cut into `num_splits`
contiguous ranges, each program writes a normalized partial output plus its log-sum-exp, and
`_reduce_splits_kernel` merges them. `choose_num_splits` picks the split count from the batch
size and context length; callers (tests) may force it.

fp8 KV caches hold `x / scale`; the kernel folds `k_scale` into the scores and `v_scale` into the
output, which equals dequantizing every element first.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .triton_utils import (
    ACTIVATION_DTYPES,
    FP8_DTYPES,
    MAX_COMBINE,
    SUM_COMBINE,
    cdiv,
    check_same_device,
    check_scale,
    check_sliding_window,
    check_tensor,
    dot_precision,
    launchable,
    next_power_of_2,
    num_sms,
)

# A split covers at least this many context tokens; shorter contexts are not split.
MIN_TOKENS_PER_SPLIT = 256
MAX_SPLITS = 32


# Arguments that change from step to step (block-table width, slices at any row) are not specialized
# on (value or 16-byte alignment): one compiled form serves every step; a form compiled mid-serving
# stalls every request in flight.
@triton.jit(
    do_not_specialize=["window", "stride_bt", "num_splits"],
    do_not_specialize_on_alignment=["window", "stride_bt", "num_splits", "block_tables_ptr", "seq_lens_ptr"],
)
def _paged_decode_kernel(
    q_ptr,  # [B, H, D]
    k_cache_ptr,  # [num_blocks, BLOCK_SIZE, KVH, D]
    v_cache_ptr,
    block_tables_ptr,  # [B, max_blocks] int32
    seq_lens_ptr,  # [B] int32
    out_ptr,  # [B, H, D] or, when WRITE_PARTIAL, [B, H, num_splits, D] fp32
    lse_ptr,  # [B, H, num_splits] fp32 (log2 domain); unused unless WRITE_PARTIAL
    qk_scale,  # softmax scale * log2(e) * k_scale
    v_scale,
    window,  # 0: no sliding window
    softcap,  # log2(e) * the logit cap; read only with USE_SOFTCAP
    stride_qb,
    stride_qh,
    stride_kb,
    stride_kt,
    stride_kh,
    stride_vb,
    stride_vt,
    stride_vh,
    stride_bt,
    stride_ob,
    stride_oh,
    stride_os,
    num_splits,
    GROUP: tl.constexpr,
    GROUP_PAD: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    HEAD_DIM_PAD: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    TILE_N: tl.constexpr,
    USE_WINDOW: tl.constexpr,
    USE_SOFTCAP: tl.constexpr,
    WRITE_PARTIAL: tl.constexpr,
    PRECISION: tl.constexpr,
):
    seq = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)

    seq_len = tl.load(seq_lens_ptr + seq)
    lo = 0
    if USE_WINDOW:
        # The query sits at seq_len - 1 and sees keys in (seq_len - 1 - window, seq_len - 1].
        lo = tl.maximum(seq_len - window, 0)
    num_tiles = (seq_len - lo + TILE_N - 1) // TILE_N
    tiles_per_split = (num_tiles + num_splits - 1) // num_splits
    start = lo + split * tiles_per_split * TILE_N
    end = tl.minimum(start + tiles_per_split * TILE_N, seq_len)

    rows = tl.arange(0, GROUP_PAD)
    heads = kv_head * GROUP + rows
    row_mask = rows < GROUP
    dims = tl.arange(0, HEAD_DIM_PAD)
    dim_mask = dims < HEAD_DIM

    q = tl.load(
        q_ptr + seq * stride_qb + heads[:, None] * stride_qh + dims[None, :],
        mask=row_mask[:, None] & dim_mask[None, :],
        other=0.0,
    )

    m_i = tl.full([GROUP_PAD], float("-inf"), tl.float32)
    l_i = tl.full([GROUP_PAD], 0.0, tl.float32)
    acc = tl.full([GROUP_PAD, HEAD_DIM_PAD], 0.0, tl.float32)

    cols = tl.arange(0, TILE_N)
    for tile_start in range(start, end, TILE_N):
        tokens = tile_start + cols
        tok_mask = tokens < end
        block_ids = tl.load(
            block_tables_ptr + seq * stride_bt + tokens // BLOCK_SIZE, mask=tok_mask, other=0
        ).to(tl.int64)
        offsets = tokens % BLOCK_SIZE
        kv_mask = tok_mask[:, None] & dim_mask[None, :]
        k = tl.load(
            k_cache_ptr
            + block_ids[:, None] * stride_kb
            + offsets[:, None] * stride_kt
            + kv_head * stride_kh
            + dims[None, :],
            mask=kv_mask,
            other=0.0,
        ).to(q.dtype)
        scores = tl.dot(q, tl.trans(k), input_precision=PRECISION) * qk_scale
        if USE_SOFTCAP:  # cap * tanh(s / cap), in the log2 domain (`softcap` holds log2(e) * cap)
            e = tl.exp(-2.0 * tl.abs(scores) / softcap)
            scores = softcap * tl.where(scores >= 0.0, (1.0 - e) / (1.0 + e), (e - 1.0) / (1.0 + e))
        scores = tl.where(tok_mask[None, :], scores, float("-inf"))
        # Every tile holds at least one valid token, so m_new is finite.
        m_new = tl.maximum(m_i, tl.reduce(scores, 1, MAX_COMBINE))
        p = tl.exp2(scores - m_new[:, None])
        alpha = tl.exp2(m_i - m_new)
        l_i = l_i * alpha + tl.reduce(p, 1, SUM_COMBINE)
        v = tl.load(
            v_cache_ptr
            + block_ids[:, None] * stride_vb
            + offsets[:, None] * stride_vt
            + kv_head * stride_vh
            + dims[None, :],
            mask=kv_mask,
            other=0.0,
        ).to(q.dtype)
        acc = acc * alpha[:, None] + tl.dot(p.to(q.dtype), v, input_precision=PRECISION)
        m_i = m_new

    # An empty range (a split past the context, or seq_len 0) leaves l_i == 0: output 0, lse -inf.
    denom = tl.where(l_i > 0.0, l_i, 1.0)
    out = acc * (v_scale / denom)[:, None]
    out_mask = row_mask[:, None] & dim_mask[None, :]
    out_offsets = seq * stride_ob + heads[:, None] * stride_oh + split * stride_os + dims[None, :]
    if WRITE_PARTIAL:
        tl.store(out_ptr + out_offsets, out, mask=out_mask)
        lse = tl.where(l_i > 0.0, m_i + tl.log2(denom), float("-inf"))
        tl.store(
            lse_ptr + (seq * GROUP * tl.num_programs(1) + heads) * num_splits + split, lse, mask=row_mask
        )
    else:
        tl.store(out_ptr + out_offsets, out.to(out_ptr.dtype.element_ty), mask=out_mask)


@triton.jit(do_not_specialize=["num_splits"], do_not_specialize_on_alignment=["num_splits"])
def _reduce_splits_kernel(
    partial_ptr,  # [B, H, num_splits, D] fp32, each split normalized on its own
    lse_ptr,  # [B, H, num_splits] fp32, log2 domain; -inf for empty splits
    out_ptr,  # [B, H, D]
    stride_ob,
    stride_oh,
    num_heads,
    num_splits,
    SPLITS_PAD: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    HEAD_DIM_PAD: tl.constexpr,
):
    seq = tl.program_id(0)
    head = tl.program_id(1)
    row = seq * num_heads + head
    splits = tl.arange(0, SPLITS_PAD)
    split_mask = splits < num_splits
    dims = tl.arange(0, HEAD_DIM_PAD)
    dim_mask = dims < HEAD_DIM

    lse = tl.load(lse_ptr + row * num_splits + splits, mask=split_mask, other=float("-inf"))
    m = tl.reduce(lse, 0, MAX_COMBINE)
    m_safe = tl.where(m == float("-inf"), 0.0, m)
    weights = tl.exp2(lse - m_safe)  # 0 for empty splits
    total = tl.reduce(weights, 0, SUM_COMBINE)
    parts = tl.load(
        partial_ptr + (row * num_splits + splits[:, None]) * HEAD_DIM + dims[None, :],
        mask=split_mask[:, None] & dim_mask[None, :],
        other=0.0,
    )
    out = tl.reduce(parts * weights[:, None], 0, SUM_COMBINE) / tl.where(total > 0.0, total, 1.0)
    tl.store(
        out_ptr + seq * stride_ob + head * stride_oh + dims, out.to(out_ptr.dtype.element_ty), mask=dim_mask
    )


def choose_num_splits(num_programs: int, max_context: int, num_sms: int) -> int:
    """Context splits for flash-decoding: enough programs for ~2 waves over `num_sms`, each split
    covering at least MIN_TOKENS_PER_SPLIT tokens, at most MAX_SPLITS; 1 for short contexts."""
    by_length = max_context // MIN_TOKENS_PER_SPLIT
    by_occupancy = cdiv(2 * num_sms, max(num_programs, 1))
    return max(1, min(by_length, by_occupancy, MAX_SPLITS))


def paged_decode_attention(
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    sliding_window: int | None = None,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
    *,
    num_splits: int | None = None,
    max_seq_len: int | None = None,
    out: torch.Tensor | None = None,
    softcap: float | None = None,
) -> torch.Tensor:
    """Attention of each sequence's single query (at position seq_len - 1) over its paged context.

    q [B, H, D] (last dim contiguous); kv_cache [2, num_blocks, block_size, KVH, D] with H % KVH == 0;
    block_tables [B, max_blocks] int32; seq_lens [B] int32 (0 gives a zero output row).
    num_splits forces the split-context count (1 = single pass); by default it follows
    `choose_num_splits` on `max_seq_len` (or the block-table capacity when not given).
    Writes into `out` ([B, H, D], q's dtype) when given. `softcap` caps the scores as
    `softcap * tanh(s / softcap)` (Gemma 2). Returns [B, H, D] in q's dtype.
    """
    check_tensor("q", q, 3, ACTIVATION_DTYPES)
    check_tensor("kv_cache", kv_cache, 5, ACTIVATION_DTYPES + FP8_DTYPES)
    check_tensor("block_tables", block_tables, 2, (torch.int32,))
    check_tensor("seq_lens", seq_lens, 1, (torch.int32,))
    device = check_same_device(q=q, kv_cache=kv_cache, block_tables=block_tables, seq_lens=seq_lens)
    batch, num_heads, head_dim = q.shape
    _, _, block_size, num_kv_heads, cache_head_dim = kv_cache.shape
    if kv_cache.shape[0] != 2:
        raise ValueError(f"kv_cache: dim 0 must be 2 (keys, values), got shape {tuple(kv_cache.shape)}")
    if cache_head_dim != head_dim:
        raise ValueError(f"kv_cache: head_dim {cache_head_dim} != q head_dim {head_dim}")
    if num_heads % num_kv_heads:
        raise ValueError(
            f"q: num_heads {num_heads} is not a multiple of kv_cache num_kv_heads {num_kv_heads}"
        )
    if block_tables.shape[0] != batch or seq_lens.shape[0] != batch:
        raise ValueError(
            f"block_tables/seq_lens: expected {batch} rows like q, got {block_tables.shape[0]} and {seq_lens.shape[0]}"
        )
    if q.stride(2) != 1 or kv_cache.stride(4) != 1 or block_tables.stride(1) != 1:
        raise ValueError("q, kv_cache and block_tables must be contiguous in their last dim")
    quantized = kv_cache.dtype in FP8_DTYPES
    if not quantized and kv_cache.dtype != q.dtype:
        raise ValueError(f"kv_cache: dtype {kv_cache.dtype} must match q ({q.dtype}) or be fp8")
    k_scale = check_scale("k_scale", k_scale, quantized)
    v_scale = check_scale("v_scale", v_scale, quantized)
    window = check_sliding_window(sliding_window)
    if out is None:
        out = torch.empty_like(q, memory_format=torch.contiguous_format)
    elif out.shape != q.shape or out.dtype != q.dtype or out.device != device or out.stride(2) != 1:
        raise ValueError(f"out: expected {tuple(q.shape)} {q.dtype} on {device}, contiguous in its last dim")
    if batch == 0:
        return out

    group = num_heads // num_kv_heads
    head_dim_pad = next_power_of_2(head_dim)
    tile_n = 32 if head_dim_pad <= 128 else 16
    if num_splits is None:
        max_context = max_seq_len if max_seq_len is not None else block_tables.shape[1] * block_size
        if window:
            max_context = min(max_context, window)
        num_splits = choose_num_splits(batch * num_kv_heads, max_context, num_sms(device))
    elif not isinstance(num_splits, int) or num_splits < 1:
        raise ValueError(f"num_splits: must be a positive int, got {num_splits!r}")

    k_cache, v_cache = kv_cache[0], kv_cache[1]
    common = {
        "qk_scale": float(scale) * 1.4426950408889634 * k_scale,
        "v_scale": v_scale,
        "window": window,
        "softcap": float(softcap) * 1.4426950408889634 if softcap else 1.0,
        "stride_qb": q.stride(0),
        "stride_qh": q.stride(1),
        "stride_kb": k_cache.stride(0),
        "stride_kt": k_cache.stride(1),
        "stride_kh": k_cache.stride(2),
        "stride_vb": v_cache.stride(0),
        "stride_vt": v_cache.stride(1),
        "stride_vh": v_cache.stride(2),
        "stride_bt": block_tables.stride(0),
        "num_splits": num_splits,
        "GROUP": group,
        "GROUP_PAD": max(16, next_power_of_2(group)),
        "HEAD_DIM": head_dim,
        "HEAD_DIM_PAD": head_dim_pad,
        "BLOCK_SIZE": block_size,
        "TILE_N": tile_n,
        "USE_WINDOW": window > 0,
        "USE_SOFTCAP": bool(softcap),
        "PRECISION": dot_precision(q.dtype),
    }
    decode = launchable(_paged_decode_kernel, device)
    grid = (batch, num_kv_heads, num_splits)
    if num_splits == 1:
        decode[grid](
            q, k_cache, v_cache, block_tables, seq_lens, out, out,
            stride_ob=out.stride(0), stride_oh=out.stride(1), stride_os=0, WRITE_PARTIAL=False, **common,
        )  # fmt: skip
        return out

    partial = torch.empty((batch, num_heads, num_splits, head_dim), dtype=torch.float32, device=device)
    lse = torch.empty((batch, num_heads, num_splits), dtype=torch.float32, device=device)
    decode[grid](
        q, k_cache, v_cache, block_tables, seq_lens, partial, lse,
        stride_ob=partial.stride(0), stride_oh=partial.stride(1), stride_os=partial.stride(2),
        WRITE_PARTIAL=True, **common,
    )  # fmt: skip
    launchable(_reduce_splits_kernel, device)[(batch, num_heads)](
        partial, lse, out, out.stride(0), out.stride(1), num_heads,
        num_splits, SPLITS_PAD=max(MAX_SPLITS, next_power_of_2(num_splits)),
        HEAD_DIM=head_dim, HEAD_DIM_PAD=head_dim_pad,
    )  # fmt: skip
    return out
