"""Paged prefill / extend attention for variable-length packed queries.

Sequence i owns queries `q[qsl[i]:qsl[i+1]]`: the last `q_len` positions of its `seq_lens[i]`-token
context, whose K/V (cached prefix and the new tokens alike) are already in the paged cache. Each
query attends causally to every earlier context position (optionally only the last
`sliding_window` of them). That one rule covers fresh prefill (no prefix), chunked prefill and
prefix-cache hits.

One program serves one (query head, tile of BLOCK_M query rows, sequence); K/V are gathered
through the block table in tiles of TILE_N tokens, so any block size works. The loop stops at the
tile's last query position (causal), and starts at the window's first position.
"""

from __future__ import annotations

from itertools import pairwise

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
)


# Arguments that change from step to step (block-table width, slices at any row) are not specialized
# on (value or 16-byte alignment): one compiled form serves every step; a form compiled mid-serving
# stalls every request in flight.
@triton.jit(
    do_not_specialize=["window", "stride_bt"],
    do_not_specialize_on_alignment=["window", "stride_bt", "block_tables_ptr", "query_start_loc_ptr", "seq_lens_ptr"],
)
def _paged_prefill_kernel(
    q_ptr,  # [T, H, D]
    k_cache_ptr,  # [num_blocks, BLOCK_SIZE, KVH, D]
    v_cache_ptr,
    block_tables_ptr,  # [S, max_blocks] int32
    query_start_loc_ptr,  # [S + 1] int32
    seq_lens_ptr,  # [S] int32
    out_ptr,  # [T, H, D]
    qk_scale,  # softmax scale * log2(e) * k_scale
    v_scale,
    window,  # 0: no sliding window
    softcap,  # log2(e) * the logit cap; read only with USE_SOFTCAP
    stride_qt,
    stride_qh,
    stride_kb,
    stride_kt,
    stride_kh,
    stride_vb,
    stride_vt,
    stride_vh,
    stride_bt,
    stride_ot,
    stride_oh,
    GROUP: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    HEAD_DIM_PAD: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    BLOCK_M: tl.constexpr,
    TILE_N: tl.constexpr,
    USE_WINDOW: tl.constexpr,
    USE_SOFTCAP: tl.constexpr,
    PRECISION: tl.constexpr,
):
    head = tl.program_id(0)
    m_tile = tl.program_id(1)
    seq = tl.program_id(2)

    q_start = tl.load(query_start_loc_ptr + seq)
    q_len = tl.load(query_start_loc_ptr + seq + 1) - q_start
    if m_tile * BLOCK_M >= q_len:
        return
    seq_len = tl.load(seq_lens_ptr + seq)
    context_len = seq_len - q_len  # positions already cached before this chunk
    kv_head = head // GROUP

    rows = m_tile * BLOCK_M + tl.arange(0, BLOCK_M)
    row_mask = rows < q_len
    positions = context_len + rows
    dims = tl.arange(0, HEAD_DIM_PAD)
    dim_mask = dims < HEAD_DIM
    q_mask = row_mask[:, None] & dim_mask[None, :]
    q = tl.load(
        q_ptr + (q_start + rows)[:, None] * stride_qt + head * stride_qh + dims[None, :],
        mask=q_mask,
        other=0.0,
    )

    # Keys [lo, hi): causal up to the tile's last valid query; the window's start for its first.
    hi = tl.minimum(context_len + (m_tile + 1) * BLOCK_M, seq_len)
    lo = 0
    if USE_WINDOW:
        lo = tl.maximum(context_len + m_tile * BLOCK_M - window + 1, 0)

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.full([BLOCK_M], 0.0, tl.float32)
    acc = tl.full([BLOCK_M, HEAD_DIM_PAD], 0.0, tl.float32)

    cols = tl.arange(0, TILE_N)
    for tile_start in range(lo, hi, TILE_N):
        tokens = tile_start + cols
        tok_mask = tokens < hi
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
        visible = tok_mask[None, :] & (tokens[None, :] <= positions[:, None])
        if USE_WINDOW:
            visible = visible & (tokens[None, :] > positions[:, None] - window)
        scores = tl.where(visible, scores, float("-inf"))
        m_new = tl.maximum(m_i, tl.reduce(scores, 1, MAX_COMBINE))
        # A row may see nothing in this tile (window / causal edges): keep its state unchanged.
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        p = tl.exp2(scores - m_safe[:, None])
        alpha = tl.exp2(m_i - m_safe)
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

    denom = tl.where(l_i > 0.0, l_i, 1.0)
    out = acc * (v_scale / denom)[:, None]
    tl.store(
        out_ptr + (q_start + rows)[:, None] * stride_ot + head * stride_oh + dims[None, :],
        out.to(out_ptr.dtype.element_ty),
        mask=q_mask,
    )


def paged_prefill_attention(
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    block_tables: torch.Tensor,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    sliding_window: int | None = None,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
    query_start_loc_cpu: list[int] | None = None,
    seq_lens_cpu: list[int] | None = None,
    *,
    max_query_len: int | None = None,
    out: torch.Tensor | None = None,
    softcap: float | None = None,
) -> torch.Tensor:
    """Causal attention of packed variable-length query chunks over their paged contexts.

    q [T, H, D] (last dim contiguous); kv_cache [2, num_blocks, block_size, KVH, D], H % KVH == 0;
    block_tables [S, max_blocks] int32; query_start_loc [S + 1] int32 (offsets into q);
    seq_lens [S] int32 with seq_lens[i] >= q_len[i]. The grid needs the longest query chunk:
    `max_query_len`, else taken from `query_start_loc_cpu`, else read from the device (a sync).
    Rows of q outside every sequence are left as they are in `out` (zeros when `out` is None).
    `softcap` caps the scores as `softcap * tanh(s / softcap)` (Gemma 2). Returns [T, H, D] in q's dtype.
    """
    check_tensor("q", q, 3, ACTIVATION_DTYPES)
    check_tensor("kv_cache", kv_cache, 5, ACTIVATION_DTYPES + FP8_DTYPES)
    check_tensor("block_tables", block_tables, 2, (torch.int32,))
    check_tensor("query_start_loc", query_start_loc, 1, (torch.int32,))
    check_tensor("seq_lens", seq_lens, 1, (torch.int32,))
    device = check_same_device(
        q=q, kv_cache=kv_cache, block_tables=block_tables, query_start_loc=query_start_loc, seq_lens=seq_lens
    )
    _num_tokens, num_heads, head_dim = q.shape
    _, _, block_size, num_kv_heads, cache_head_dim = kv_cache.shape
    num_seqs = seq_lens.shape[0]
    if kv_cache.shape[0] != 2:
        raise ValueError(f"kv_cache: dim 0 must be 2 (keys, values), got shape {tuple(kv_cache.shape)}")
    if cache_head_dim != head_dim:
        raise ValueError(f"kv_cache: head_dim {cache_head_dim} != q head_dim {head_dim}")
    if num_heads % num_kv_heads:
        raise ValueError(
            f"q: num_heads {num_heads} is not a multiple of kv_cache num_kv_heads {num_kv_heads}"
        )
    if query_start_loc.shape[0] != num_seqs + 1:
        raise ValueError(f"query_start_loc: expected {num_seqs + 1} entries, got {query_start_loc.shape[0]}")
    if block_tables.shape[0] != num_seqs:
        raise ValueError(f"block_tables: expected {num_seqs} rows like seq_lens, got {block_tables.shape[0]}")
    if q.stride(2) != 1 or kv_cache.stride(4) != 1 or block_tables.stride(1) != 1:
        raise ValueError("q, kv_cache and block_tables must be contiguous in their last dim")
    quantized = kv_cache.dtype in FP8_DTYPES
    if not quantized and kv_cache.dtype != q.dtype:
        raise ValueError(f"kv_cache: dtype {kv_cache.dtype} must match q ({q.dtype}) or be fp8")
    k_scale = check_scale("k_scale", k_scale, quantized)
    v_scale = check_scale("v_scale", v_scale, quantized)
    window = check_sliding_window(sliding_window)
    if out is None:
        out = torch.zeros_like(q, memory_format=torch.contiguous_format)
    elif out.shape != q.shape or out.dtype != q.dtype or out.device != device or out.stride(2) != 1:
        raise ValueError(f"out: expected {tuple(q.shape)} {q.dtype} on {device}, contiguous in its last dim")

    if max_query_len is None:
        if query_start_loc_cpu is not None:
            if len(query_start_loc_cpu) != num_seqs + 1:
                raise ValueError(
                    f"query_start_loc_cpu: expected {num_seqs + 1} entries, got {len(query_start_loc_cpu)}"
                )
            max_query_len = max((b - a for a, b in pairwise(query_start_loc_cpu)), default=0)
        else:
            max_query_len = int((query_start_loc[1:] - query_start_loc[:-1]).max()) if num_seqs else 0
    if num_seqs == 0 or max_query_len <= 0:
        return out

    head_dim_pad = next_power_of_2(head_dim)
    block_m = 64 if head_dim_pad <= 128 else 32  # not by query length: one compiled form per model
    tile_n = 32 if head_dim_pad <= 128 else 16
    k_cache, v_cache = kv_cache[0], kv_cache[1]
    grid = (num_heads, cdiv(max_query_len, block_m), num_seqs)
    launchable(_paged_prefill_kernel, device)[grid](
        q, k_cache, v_cache, block_tables, query_start_loc, seq_lens, out,
        float(scale) * 1.4426950408889634 * k_scale, v_scale, window,
        float(softcap) * 1.4426950408889634 if softcap else 1.0,
        q.stride(0), q.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        block_tables.stride(0), out.stride(0), out.stride(1),
        GROUP=num_heads // num_kv_heads, HEAD_DIM=head_dim, HEAD_DIM_PAD=head_dim_pad,
        BLOCK_SIZE=block_size, BLOCK_M=block_m, TILE_N=tile_n,
        USE_WINDOW=window > 0, USE_SOFTCAP=bool(softcap), PRECISION=dot_precision(q.dtype),
    )  # fmt: skip
    return out
