"""Pure-torch reference ops: the ground truth for the Triton kernels and the CPU attention backend.

Every function here is exact (up to floating point) and batched: no per-token Python. Host syncs
happen only where noted (the -1 check in `reshape_and_cache`; prefill without host lists).

KV cache layout (per layer): `[2, num_blocks, block_size, num_kv_heads, head_dim]`, index 0 keys,
1 values. Token t of a sequence lives in block `block_table[t // block_size]` at offset
`t % block_size`; its flat slot is `block_id * block_size + offset`. An fp8 cache stores
`x / scale` and reads back `stored * scale`.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

_FP8_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)


def is_fp8(dtype: torch.dtype) -> bool:
    return dtype in _FP8_DTYPES


def reshape_and_cache(
    key: torch.Tensor,
    value: torch.Tensor,
    kv_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
    all_valid: bool = False,
) -> None:
    """Write key/value `[T, KVH, D]` into `kv_cache` at `slot_mapping` `[T]` (int64; -1 = skip), in place.

    An fp8 cache stores `(x / scale)` saturated to the fp8 range. Slots must be distinct (apart
    from -1). Checking for -1 reads the slots on the host once; `all_valid=True` (the caller already
    dropped the -1 slots) skips the check.
    """
    num_kv_heads, head_dim = kv_cache.shape[-2], kv_cache.shape[-1]
    key_cache = kv_cache[0].view(-1, num_kv_heads, head_dim)
    value_cache = kv_cache[1].view(-1, num_kv_heads, head_dim)
    if is_fp8(kv_cache.dtype):
        limit = torch.finfo(kv_cache.dtype).max
        key = (key.float() / k_scale).clamp_(-limit, limit).to(kv_cache.dtype)
        value = (value.float() / v_scale).clamp_(-limit, limit).to(kv_cache.dtype)
        # index_copy_ has no fp8 kernels everywhere; the bytes are what we store.
        key_cache, value_cache = key_cache.view(torch.uint8), value_cache.view(torch.uint8)
        key, value = key.view(torch.uint8), value.view(torch.uint8)
    else:
        key, value = key.to(kv_cache.dtype), value.to(kv_cache.dtype)
    slots = slot_mapping.to(torch.int64)
    if not all_valid:
        valid = slots >= 0
        # The common case (no skipped tokens) avoids a data-dependent boolean gather.
        if not bool(valid.all()):
            slots, key, value = slots[valid], key[valid], value[valid]
    key_cache.index_copy_(0, slots, key)
    value_cache.index_copy_(0, slots, value)


def gather_kv(
    cache: torch.Tensor, block_ids: torch.Tensor, num_seqs: int, out: torch.Tensor | None = None
) -> torch.Tensor:
    """Gather whole blocks of one cache half `[num_blocks, bs, KVH, D]` for `num_seqs` sequences.

    `block_ids`: flat int64 `[num_seqs * blocks_per_seq]`. Returns `[num_seqs, blocks_per_seq * bs, KVH, D]`
    in the cache's dtype; written into `out` (a flat buffer with at least that many elements) when given.
    """
    block_size, num_kv_heads, head_dim = cache.shape[1:]
    fp8 = is_fp8(cache.dtype)
    src = cache.view(torch.uint8) if fp8 else cache  # index_select has no fp8 kernels everywhere
    shape = (block_ids.shape[0], block_size, num_kv_heads, head_dim)
    if out is None:
        gathered = src.index_select(0, block_ids)
    else:
        gathered = out.view(src.dtype)[: block_ids.shape[0] * block_size * num_kv_heads * head_dim].view(shape)
        torch.index_select(src, 0, block_ids, out=gathered)
    if fp8:
        gathered = gathered.view(cache.dtype)
    return gathered.view(num_seqs, -1, num_kv_heads, head_dim)


def dequantize(x: torch.Tensor, dtype: torch.dtype, scale: float) -> torch.Tensor:
    """Read a (gathered) cache slice as `dtype`: fp8 values are multiplied by `scale`."""
    if is_fp8(x.dtype):
        out = x.to(dtype)
        return out * scale if scale != 1.0 else out
    return x if x.dtype == dtype else x.to(dtype)


def decode_mask(seq_lens: torch.Tensor, max_len: int, sliding_window: int | None) -> torch.Tensor:
    """Boolean `[B, max_len]`: key position k is visible to the query at `seq_lens[b] - 1`."""
    pos = torch.arange(max_len, device=seq_lens.device).unsqueeze(0)
    lens = seq_lens.to(torch.int64).unsqueeze(1)
    mask = pos < lens
    if sliding_window is not None:
        mask &= pos >= lens - sliding_window
    return mask


def attend_decode(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, mask: torch.Tensor | None,
                  scale: float, softcap: float | None = None) -> torch.Tensor:
    """q `[B, H, D]` against keys/values `[B, L, KVH, D]` (any strides) under `mask` `[B, L]` -> `[B, H, D]`.

    `mask=None`: every key is visible (callers pass exactly the visible keys). Each KV head's query
    group is treated as a short query sequence, so GQA needs no K/V expansion. `softcap`: scores
    become `softcap * tanh(scores / softcap)` before the softmax (Gemma 2).
    """
    num_seqs, num_heads, head_dim = q.shape
    num_kv_heads = keys.shape[2]
    grouped = q.reshape(num_seqs, num_kv_heads, num_heads // num_kv_heads, head_dim)
    mask = None if mask is None else mask[:, None, None, :]
    if softcap is not None:
        out = softcapped_attention(grouped, keys.transpose(1, 2), values.transpose(1, 2), mask, scale, softcap)
    else:
        out = F.scaled_dot_product_attention(grouped, keys.transpose(1, 2), values.transpose(1, 2),
                                             attn_mask=mask, scale=scale)
    return out.reshape(num_seqs, num_heads, head_dim)


def softcapped_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, mask: torch.Tensor | None,
                         scale: float, softcap: float) -> torch.Tensor:
    """Attention with capped scores, as Hugging Face's eager Gemma 2 computes it: query `[..., Q, D]`,
    key/value `[..., L, D]` (same leading dims), boolean `mask` broadcastable to `[..., Q, L]` or None
    (all visible). Scores in the inputs' dtype, softmax in float32."""
    scores = torch.matmul(query, key.transpose(-1, -2)) * scale
    scores = torch.tanh(scores / softcap) * softcap
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf"))
    probs = torch.softmax(scores.float(), dim=-1).to(value.dtype)
    return torch.matmul(probs, value)


def attend_prefill(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, mask: torch.Tensor | None,
                   scale: float, softcap: float | None = None) -> torch.Tensor:
    """One sequence: q `[q_len, H, D]` (the last q_len positions) against keys/values `[L, KVH, D]`.

    `mask` `[q_len, L]` (see `causal_mask`), or None when q covers the whole context without a
    window, which uses the plain causal kernel. `softcap`: see `attend_decode`. Returns `[q_len, H, D]`.
    """
    query = q.transpose(0, 1).unsqueeze(0)
    k, v = keys.transpose(0, 1).unsqueeze(0), values.transpose(0, 1).unsqueeze(0)
    gqa = q.shape[1] != keys.shape[1]
    if softcap is not None:
        group = q.shape[1] // keys.shape[1]
        if mask is None:
            mask = causal_mask(q.shape[0], keys.shape[0], None, q.device)
        out = softcapped_attention(query, k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1),
                                   mask, scale, softcap)
        return out[0].transpose(0, 1)
    if mask is None:
        out = F.scaled_dot_product_attention(query, k, v, is_causal=True, scale=scale, enable_gqa=gqa)
    else:
        out = F.scaled_dot_product_attention(query, k, v, attn_mask=mask, scale=scale, enable_gqa=gqa)
    return out[0].transpose(0, 1)


def prefill_mask(q_len: int, seq_len: int, sliding_window: int | None, device: torch.device) -> torch.Tensor | None:
    """The mask `attend_prefill` needs: None for a plain causal prefill, else `causal_mask`."""
    if q_len == seq_len and (sliding_window is None or sliding_window >= seq_len):
        return None
    return causal_mask(q_len, seq_len, sliding_window, device)


def causal_mask(q_len: int, seq_len: int, sliding_window: int | None, device: torch.device) -> torch.Tensor:
    """Boolean `[q_len, seq_len]`: query j (at position seq_len - q_len + j) may see key k."""
    q_pos = torch.arange(seq_len - q_len, seq_len, device=device).unsqueeze(1)
    k_pos = torch.arange(seq_len, device=device).unsqueeze(0)
    mask = k_pos <= q_pos
    if sliding_window is not None:
        mask &= k_pos > q_pos - sliding_window
    return mask


def paged_decode_attention(
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    sliding_window: int | None = None,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
) -> torch.Tensor:
    """One query per sequence at position `seq_lens[b] - 1`, attending to its cached context.

    q `[B, H, D]`, block_tables `[B, max_blocks]` int32, seq_lens `[B]` int32 (>= 1). GQA: H % KVH == 0.
    Every column of `block_tables` is read, so callers should trim it to the longest sequence.
    Returns `[B, H, D]` in q's dtype.
    """
    num_seqs = q.shape[0]
    if num_seqs == 0:
        return q.new_empty(q.shape)
    block_ids = block_tables.reshape(-1).to(torch.int64)
    keys = dequantize(gather_kv(kv_cache[0], block_ids, num_seqs), q.dtype, k_scale)
    values = dequantize(gather_kv(kv_cache[1], block_ids, num_seqs), q.dtype, v_scale)
    mask = decode_mask(seq_lens, keys.shape[1], sliding_window)
    return attend_decode(q, keys, values, mask, scale)


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
) -> torch.Tensor:
    """Causal attention for packed variable-length queries over the paged cache.

    q `[T, H, D]`; sequence i owns `q[query_start_loc[i]:query_start_loc[i + 1]]`, which are the
    last `q_len` positions of its `seq_lens[i]` context (earlier positions are already cached).
    The host lists avoid device syncs; without them the tensors are copied to the host once.
    Returns `[T, H, D]` in q's dtype.
    """
    starts = query_start_loc_cpu if query_start_loc_cpu is not None else query_start_loc.tolist()
    lens = seq_lens_cpu if seq_lens_cpu is not None else seq_lens.tolist()
    block_size = kv_cache.shape[2]
    out = torch.empty_like(q)
    for i, seq_len in enumerate(lens):
        q_start, q_end = starts[i], starts[i + 1]
        if q_end == q_start:
            continue
        block_ids = block_tables[i, : -(-seq_len // block_size)].to(torch.int64)
        keys = dequantize(gather_kv(kv_cache[0], block_ids, 1)[0, :seq_len], q.dtype, k_scale)
        values = dequantize(gather_kv(kv_cache[1], block_ids, 1)[0, :seq_len], q.dtype, v_scale)
        mask = prefill_mask(q_end - q_start, seq_len, sliding_window, q.device)
        out[q_start:q_end] = attend_prefill(q[q_start:q_end], keys, values, mask, scale)
    return out


def rms_norm(
    x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """`x * rsqrt(mean(x^2) + eps) * weight`, computed in fp32, returned in x's dtype.

    With `residual`: `s = x + residual` (in x's dtype); returns `(rms_norm(s), s)`.
    """
    if residual is not None:
        summed = x + residual
        return rms_norm(summed, weight, eps), summed
    x32 = x.float()
    normed = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return weight * normed.to(x.dtype)


def rotary_embedding(
    positions: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    cos_sin_cache: torch.Tensor,
    is_neox: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotate the first `rot_dim` dims of q `[T, H, D]` and k `[T, KVH, D]` at `positions` `[T]`.

    `cos_sin_cache` is `[max_pos, rot_dim]` = `cat(cos, sin)` over `rot_dim // 2` frequencies.
    Neox style rotates the two halves; GPT-J style rotates interleaved (even, odd) pairs.
    Returns new tensors in the inputs' dtypes.
    """
    cos_sin = cos_sin_cache.index_select(0, positions.to(torch.int64))
    cos, sin = cos_sin.chunk(2, dim=-1)
    cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)  # [T, 1, rot_dim // 2]
    return rotate(q, cos, sin, is_neox), rotate(k, cos, sin, is_neox)


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, is_neox: bool) -> torch.Tensor:
    """Rotate the first `2 * cos.shape[-1]` dims of x `[T, H, D]` by cos/sin `[T, 1, rot_dim // 2]`."""
    rot_dim = cos.shape[-1] * 2
    cos, sin = cos.to(x.dtype), sin.to(x.dtype)
    x_rot, x_pass = x[..., :rot_dim], x[..., rot_dim:]
    if is_neox:
        x1, x2 = x_rot.chunk(2, dim=-1)
        rotated = torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)
    else:
        x1, x2 = x_rot[..., 0::2], x_rot[..., 1::2]
        rotated = torch.stack((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1).flatten(-2)
    if x_pass.shape[-1] == 0:
        return rotated
    return torch.cat((rotated, x_pass), dim=-1)


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """x `[T, 2N]` -> `silu(x[:, :N]) * x[:, N:]`."""
    gate, up = x.chunk(2, dim=-1)
    return F.silu(gate) * up


def sort_by_expert(topk_ids: torch.Tensor, num_experts: int) -> tuple[torch.Tensor, torch.Tensor, list[int]]:
    """The token-expert pairs of `topk_ids [T, k]` grouped by expert: `(order, tokens, counts)`.

    `order [T*k]`: flat pair indices (`t * k + j`) sorted by expert, token order kept within an
    expert; `tokens = order // k`; `counts[e]`: pairs routed to expert e (read on the host: one sync).
    """
    flat = topk_ids.reshape(-1)
    order = flat.argsort(stable=True)
    counts = torch.bincount(flat, minlength=num_experts).tolist()
    return order, order // topk_ids.shape[1], counts


def grouped_moe(x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor, num_experts: int,
                expert_fn, out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """Each token's `sum_j topk_weights[t, j] * expert_fn(topk_ids[t, j], x[t])`, grouped by expert:
    the pairs sorted by expert, `expert_fn(e, rows [n_e, H]) -> [n_e, H]` called once per expert that
    has pairs (no per-token Python), weighted and summed per token with `index_add_` in float32 (in
    expert order for every token, as Hugging Face does). Returns `[T, H]` in `out_dtype` (x's dtype)."""
    order, tokens, counts = sort_by_expert(topk_ids, num_experts)
    rows = x.index_select(0, tokens)
    weights = topk_weights.reshape(-1).index_select(0, order).float().unsqueeze(1)
    expert_out = torch.empty(rows.shape, dtype=torch.float32, device=x.device)
    start = 0
    for expert, n in enumerate(counts):
        if n:
            expert_out[start:start + n] = expert_fn(expert, rows[start:start + n])
            start += n
    out = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
    out.index_add_(0, tokens, expert_out.mul_(weights))
    return out if out_dtype == torch.float32 else out.to(out_dtype or x.dtype)


def fused_moe(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor,
              topk_ids: torch.Tensor) -> torch.Tensor:
    """The routed experts' SwiGLU MLPs: x `[T, H]`, stacked gate|up weights `w13 [E, 2I, H]` (gate rows
    first), down weights `w2 [E, H, I]`, each token's experts `topk_ids [T, k]` and their weights
    `topk_weights [T, k]` -> `[T, H]` in x's dtype (`grouped_moe` with one matmul pair per expert)."""

    def expert(e: int, rows: torch.Tensor) -> torch.Tensor:
        return F.linear(silu_and_mul(F.linear(rows, w13[e])), w2[e])

    return grouped_moe(x, topk_weights, topk_ids, w13.shape[0], expert)


def unpack_codes(qweight: torch.Tensor, bits: int, k: int) -> torch.Tensor:
    """The codes `[K, N]` (int64) of a `dequant_gemm.pack_codes` weight `qweight [ceil(K / P), N]`."""
    per = 32 // bits
    shifts = (torch.arange(per, device=qweight.device, dtype=torch.int64) * bits).view(1, per, 1)
    codes = (qweight.to(torch.int64).unsqueeze(1) >> shifts) & ((1 << bits) - 1)
    return codes.reshape(-1, qweight.shape[1])[:k]


def dequant_gemm(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor | None,
                 bits: int, group_size: int, bias: torch.Tensor | None = None) -> torch.Tensor:
    """`x [M, K]` times the weight `w[k, n] = (q[k, n] - zeros[g, n]) * scales[g, n]` (fp32; `g = k //
    group_size`, -1: one group; zeros None: `2**(bits-1)`) packed by `dequant_gemm.pack_codes`, rounded to
    x's dtype, products accumulated in fp32 (+ bias), result in x's dtype: `[M, N]`."""
    k = x.shape[1]
    codes = unpack_codes(qweight, bits, k).float()
    gs = k if group_size == -1 else group_size
    g = torch.arange(k, device=x.device) // gs
    zero = zeros[g] if zeros is not None else float(2 ** (bits - 1))
    w = ((codes - zero) * scales[g]).to(x.dtype)
    y = x.float() @ w.float()
    if bias is not None:
        y = y + bias.float()
    return y.to(x.dtype)
