"""Per-request runner state and the step's flat model inputs (SchedulerOutput -> tensors).

The runner keeps a `CachedRequestState` per live request: its one token list (prompt, then outputs;
its sampling state reads the same list), block table and sampling state. `build_model_inputs` turns one step's schedule into packed tensors with decode
sequences first, built with numpy in a handful of vector ops (no per-token Python).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from aserve.model.attention.base import AttentionMetadata
from aserve.runner.sampling import RequestSampling
from aserve.sampling_params import SamplingParams


@dataclass
class CachedRequestState:
    req_id: str
    token_ids: list[int]  # prompt + outputs; the runner appends each sampled token
    num_prompt_tokens: int
    params: SamplingParams
    block_ids: list[int]
    num_computed_tokens: int
    sampling: RequestSampling  # reads `token_ids` (the same list)

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)


@dataclass
class ModelInputs:
    input_ids: torch.Tensor  # [T] int64
    positions: torch.Tensor  # [T] int64
    meta: AttentionMetadata
    req_ids: list[str]  # batch order (decodes first)
    num_scheduled: list[int]  # per sequence, batch order
    sample_req_ids: list[str]  # requests that sample, in batch order
    logits_indices: list[int]  # flat index of each sampling request's last token (and of its drafts, before it)
    # prompt logprobs: req_id -> (flat start index, count, first target position)
    prompt_logprob_spans: dict[str, tuple[int, int, int]]


def build_model_inputs(
    states: dict[str, CachedRequestState],
    scheduled_req_ids: list[str],
    num_scheduled_tokens: list[int],
    block_size: int,
    device: torch.device,
    pad_to_num_seqs: int | None = None,
    spec_token_ids: dict[str, list[int]] | None = None,
) -> ModelInputs:
    """Pack one step. `pad_to_num_seqs` pads a batch of decode rows to a fixed size (graphs / static shapes):
    padded rows write nowhere (slot -1), read the reserved null block 0 and are never sampled.
    `spec_token_ids`: drafts that follow a request's tokens this step (speculative decoding); the
    request's logits rows are then its last token's and each draft's. Attention sees such a request as
    one decode row per token (batch expansion: row j attends to the positions up to its own, and every
    new K/V is written before any row attends), so verification runs on the decode paths."""
    spec = spec_token_ids or {}
    order = sorted(range(len(scheduled_req_ids)),
                   key=lambda i: num_scheduled_tokens[i] != 1 and scheduled_req_ids[i] not in spec)
    req_ids = [scheduled_req_ids[i] for i in order]
    counts = np.fromiter((num_scheduled_tokens[i] for i in order), dtype=np.int64, count=len(order))
    num_seqs = len(req_ids)
    seq_states = [states[r] for r in req_ids]
    starts = np.fromiter((s.num_computed_tokens for s in seq_states), dtype=np.int64, count=num_seqs)
    seq_lens = starts + counts
    num_decodes = int(np.count_nonzero(counts == 1))  # sorted: the decodes are the leading run
    total = int(counts.sum())

    # Token ids and positions: decodes take one token each; prefills take a slice.
    if num_decodes == num_seqs:
        input_ids = np.fromiter((s.token_ids[int(p)] for s, p in zip(seq_states, starts)), dtype=np.int64,
                                count=num_seqs)
        positions = starts.copy()
    else:
        input_ids = np.concatenate([np.asarray(s.token_ids[int(a):int(b)] + spec[s.req_id]
                                               if s.req_id in spec else s.token_ids[int(a):int(b)], dtype=np.int64)
                                    for s, a, b in zip(seq_states, starts, seq_lens)])
        cu = np.concatenate(([0], np.cumsum(counts)))
        positions = np.arange(total, dtype=np.int64) - np.repeat(cu[:-1] - starts, counts)

    max_blocks = max((len(s.block_ids) for s in seq_states), default=1)
    block_table = np.zeros((num_seqs, max(max_blocks, 1)), dtype=np.int32)
    for i, s in enumerate(seq_states):
        block_table[i, : len(s.block_ids)] = s.block_ids
    seq_index = np.repeat(np.arange(num_seqs), counts)
    slot_mapping = block_table[seq_index, positions // block_size].astype(np.int64) * block_size + positions % block_size

    query_start_loc = np.zeros(num_seqs + 1, dtype=np.int32)
    np.cumsum(counts, out=query_start_loc[1:])

    rows = (num_seqs, num_decodes, counts, seq_lens, block_table, query_start_loc)
    if spec:
        rows = _expand_verify_rows([r in spec for r in req_ids], starts, *rows[2:])
    meta_seqs, meta_decodes, meta_counts, meta_lens, meta_table, meta_starts = rows
    if pad_to_num_seqs is not None and pad_to_num_seqs > meta_seqs:
        assert meta_decodes == meta_seqs, "only decode-only batches are padded"
        pad = pad_to_num_seqs - meta_seqs
        input_ids = np.concatenate((input_ids, np.zeros(pad, dtype=np.int64)))
        positions = np.concatenate((positions, np.zeros(pad, dtype=np.int64)))
        slot_mapping = np.concatenate((slot_mapping, np.full(pad, -1, dtype=np.int64)))
        meta_table = np.concatenate((meta_table, np.zeros((pad, meta_table.shape[1]), dtype=np.int32)))
        meta_lens = np.concatenate((meta_lens, np.ones(pad, dtype=np.int64)))
        meta_starts = np.arange(pad_to_num_seqs + 1, dtype=np.int32)
        meta_counts = np.concatenate((meta_counts, np.ones(pad, dtype=np.int64)))
        meta_seqs = meta_decodes = total = pad_to_num_seqs

    seq_lens32 = meta_lens.astype(np.int32)
    meta = AttentionMetadata(
        num_tokens=total,
        num_seqs=meta_seqs,
        num_decodes=meta_decodes,
        num_decode_tokens=meta_decodes,
        slot_mapping=torch.from_numpy(slot_mapping).to(device, non_blocking=True),
        query_start_loc=torch.from_numpy(meta_starts).to(device, non_blocking=True),
        seq_lens=torch.from_numpy(seq_lens32).to(device, non_blocking=True),
        block_tables=torch.from_numpy(meta_table).to(device, non_blocking=True),
        max_query_len=int(meta_counts.max()) if meta_seqs else 0,
        max_seq_len=int(meta_lens.max()) if meta_seqs else 0,
        query_start_loc_cpu=meta_starts.tolist(),
        seq_lens_cpu=seq_lens32.tolist(),
    )

    sample_req_ids: list[str] = []
    logits_indices: list[int] = []
    spans: dict[str, tuple[int, int, int]] = {}
    ends = query_start_loc[1:]
    for i, s in enumerate(seq_states):
        end = int(seq_lens[i])
        if end >= s.num_tokens:  # every token computed after this step -> sample
            sample_req_ids.append(s.req_id)
            num_rows = end - s.num_tokens + 1  # 1 + drafts
            logits_indices.extend(range(int(ends[i]) - num_rows, int(ends[i])))
        if s.params.prompt_logprobs is not None:
            start = int(starts[i])
            num_prompt = s.num_prompt_tokens
            # Logits at position p score prompt token p + 1; only positions < num_prompt - 1 have a target.
            last = min(end, num_prompt - 1)
            if last > start:
                spans[s.req_id] = (int(query_start_loc[i]), last - start, start + 1)

    return ModelInputs(
        input_ids=torch.from_numpy(input_ids).to(device, non_blocking=True),
        positions=torch.from_numpy(positions).to(device, non_blocking=True),
        meta=meta,
        req_ids=req_ids,
        num_scheduled=counts.tolist(),
        sample_req_ids=sample_req_ids,
        logits_indices=logits_indices,
        prompt_logprob_spans=spans,
    )


def _expand_verify_rows(verify: list[bool], starts: np.ndarray, counts: np.ndarray, seq_lens: np.ndarray,
                        block_table: np.ndarray, query_start_loc: np.ndarray):
    """Attention rows with each verifying request (sorted among the decodes) split into one decode row
    per token. Returns (rows, decode rows, query lengths, seq lens, block table, query start locations)."""
    mask = np.asarray(verify, dtype=bool)
    per_req = np.where(mask, counts, 1)
    row_req = np.repeat(np.arange(len(verify)), per_req)
    num_rows = int(per_req.sum())
    offset = np.arange(num_rows) - np.repeat(np.cumsum(per_req) - per_req, per_req)
    row_verify = mask[row_req]
    lens = np.where(row_verify, starts[row_req] + 1 + offset, seq_lens[row_req])
    row_counts = np.where(row_verify, 1, counts[row_req])
    loc = np.zeros(num_rows + 1, dtype=np.int32)
    np.cumsum(row_counts, out=loc[1:])
    num_decodes = int(np.argmax(row_counts != 1)) if (row_counts != 1).any() else num_rows
    return num_rows, num_decodes, row_counts, lens, block_table[row_req], loc


def advance_decode_inputs(inputs: ModelInputs, next_token_ids: list[int], block_size: int) -> ModelInputs:
    """`inputs`, a decode-only step, turned in place into the next decode step of the same requests
    (multi-step decode): each real row's input is its token `next_token_ids[i]` (batch order), one
    position further, its context one longer, its slot the next one in its block table (which must
    already hold the block: the scheduler reserved it). Padded rows are left as they are. Equals
    what `build_model_inputs` would build, without rebuilding it on the host."""
    meta = inputs.meta
    n = len(next_token_ids)
    inputs.input_ids[:n].copy_(torch.tensor(next_token_ids, dtype=torch.int64), non_blocking=True)
    inputs.positions[:n] += 1
    meta.seq_lens[:n] += 1
    positions = inputs.positions[:n]
    blocks = meta.block_tables[:n].gather(1, (positions // block_size).unsqueeze(1)).squeeze(1)
    meta.slot_mapping[:n] = blocks.to(torch.int64) * block_size + positions % block_size
    meta.seq_lens_cpu = [length + 1 for length in meta.seq_lens_cpu[:n]] + meta.seq_lens_cpu[n:]
    meta.max_seq_len = max(meta.seq_lens_cpu)
    return inputs
