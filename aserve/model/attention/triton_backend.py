"""The Triton attention backend (GPU; CPU tensors under TRITON_INTERPRET=1, as CI tests it).

Same contract as the torch backend: write this step's K/V into the paged cache, then run the
decode kernel for the first `meta.num_decodes` sequences and the prefill/extend kernel for the
rest, writing both into one output. Shapes come from the metadata's host lists, so nothing here
syncs with the device.
"""

from __future__ import annotations

import torch

from aserve.kernels.paged_decode_attention import paged_decode_attention
from aserve.kernels.paged_prefill_attention import paged_prefill_attention
from aserve.kernels.reshape_and_cache import reshape_and_cache
from aserve.model.attention.base import AttentionMetadata


class TritonAttentionBackend:
    """q [T, H, D], k/v [T, KVH, D], kv_cache [2, num_blocks, block_size, KVH, D] -> [T, H, D].

    Rows past `meta.num_tokens` (a padded batch) are zeros; slots of -1 are not written.
    """

    name = "triton"

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        kv_cache: torch.Tensor,
        meta: AttentionMetadata,
        scale: float,
        sliding_window: int | None = None,
        logit_softcap: float | None = None,
        k_scale: float = 1.0,
        v_scale: float = 1.0,
    ) -> torch.Tensor:
        num_tokens = meta.num_tokens
        reshape_and_cache(
            k[:num_tokens],
            v[:num_tokens],
            kv_cache,
            meta.slot_mapping[:num_tokens],
            k_scale,
            v_scale,
        )
        out = torch.empty_like(q) if q.shape[0] == num_tokens else torch.zeros_like(q)
        num_decodes = meta.num_decodes
        if num_decodes:
            paged_decode_attention(
                q[:num_decodes], kv_cache, meta.block_tables[:num_decodes], meta.seq_lens[:num_decodes],
                scale, sliding_window, k_scale, v_scale,
                max_seq_len=max(meta.seq_lens_cpu[:num_decodes]), out=out[:num_decodes], softcap=logit_softcap,
            )  # fmt: skip
        if meta.num_seqs > num_decodes:
            starts = meta.query_start_loc_cpu[num_decodes : meta.num_seqs + 1]
            first = starts[0]
            paged_prefill_attention(
                q[first:num_tokens], kv_cache, meta.block_tables[num_decodes : meta.num_seqs],
                meta.query_start_loc[num_decodes : meta.num_seqs + 1] - first,
                meta.seq_lens[num_decodes : meta.num_seqs], scale, sliding_window,
                k_scale, v_scale,
                query_start_loc_cpu=[s - first for s in starts],
                seq_lens_cpu=meta.seq_lens_cpu[num_decodes : meta.num_seqs],
                out=out[first:num_tokens], softcap=logit_softcap,
            )  # fmt: skip
        return out
