"""The pure-torch attention backend (CPU, and a reference on any device), built on `aserve.kernels.reference`."""

from __future__ import annotations

import torch

from aserve.kernels import reference
from aserve.model.attention.base import AttentionMetadata


class TorchAttentionBackend:
    """Writes K/V with `reshape_and_cache`, then runs decodes as one batched masked SDPA and each
    prefill/extend sequence as its own (offset-)causal SDPA. Uses only the metadata's host lists
    for shapes, so it never syncs with the device."""

    name = "torch"

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        kv_cache: torch.Tensor,
        meta: AttentionMetadata,
        scale: float,
    ) -> torch.Tensor:
        num_tokens = meta.num_tokens
        reference.reshape_and_cache(k[:num_tokens], v[:num_tokens], kv_cache, meta.slot_mapping[:num_tokens],
                                    meta.k_scale, meta.v_scale)
        if q.shape[0] == num_tokens:
            out = torch.empty_like(q)
        else:  # padded batch: padding rows are zeros
            out = torch.zeros_like(q)
        block_size = kv_cache.shape[2]
        num_decodes = meta.num_decodes
        if num_decodes:
            max_decode_len = max(meta.seq_lens_cpu[:num_decodes])
            num_blocks = -(-max_decode_len // block_size)
            out[:num_decodes] = reference.paged_decode_attention(
                q[:num_decodes], kv_cache, meta.block_tables[:num_decodes, :num_blocks],
                meta.seq_lens[:num_decodes], scale, meta.sliding_window, meta.k_scale, meta.v_scale,
            )
        if meta.num_seqs > num_decodes:
            starts = meta.query_start_loc_cpu[num_decodes:meta.num_seqs + 1]
            first = starts[0]
            out[first:num_tokens] = reference.paged_prefill_attention(
                q[first:num_tokens], kv_cache, meta.block_tables[num_decodes:meta.num_seqs],
                meta.query_start_loc[num_decodes:meta.num_seqs + 1] - first,
                meta.seq_lens[num_decodes:meta.num_seqs], scale, meta.sliding_window,
                meta.k_scale, meta.v_scale,
                query_start_loc_cpu=[s - first for s in starts],
                seq_lens_cpu=meta.seq_lens_cpu[num_decodes:meta.num_seqs],
            )
        return out
