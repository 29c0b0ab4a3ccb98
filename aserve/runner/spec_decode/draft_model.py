"""A draft model (vLLM's `draft_model` method): a smaller causal LM with the target's vocabulary proposes
drafts greedily.

Its KV cache has the target's block layout: the same block ids, one draft tensor per draft layer, so
the scheduler's block tables (prefix-cache hits, swaps and lookahead slots included) serve both
models. Each step the draft first runs over exactly the target's inputs (`catch_up`), so its cache
always holds every position the target computed (rejected drafts' positions are rewritten later, as
the target's are); then, for the requests that sampled, k greedy decode passes starting at the newest
token propose the drafts. Those passes write draft K/V up to k - 1 positions past the newest token:
the scheduler reserves `num_lookahead_slots` (= k) slots past every step's tokens for them.

The draft's context (`max_position_embeddings`) may be shorter than the target's: catch-up rows past
it write nowhere and use clamped positions (their outputs are never used), and a request gets drafts
only while all of them fit in both contexts (`SpeculativeConfig.max_model_len` trims the same way).
"""

from __future__ import annotations

import dataclasses

import numpy as np
import torch

from aserve.config import AserveConfig, LoRAConfig
from aserve.model.attention.base import AttentionMetadata
from aserve.model.loader import kv_cache_dtype_for, load_model
from aserve.runner.input_batch import CachedRequestState, ModelInputs
from aserve.runner.kv_memory import zeroed
from aserve.runner.spec_decode.base import Proposer


def draft_model_config(config: AserveConfig) -> AserveConfig:
    """The target's config with the draft's folder and architecture (no LoRA, no quantization)."""
    spec = config.speculative
    model = dataclasses.replace(config.model, model_path=spec.draft_model_path, arch=spec.draft_arch,
                                hf_overrides=None, model_impl="aserve")
    load_format = config.load.load_format if config.load.load_format in ("dummy", "safetensors", "pt") else "auto"
    load = dataclasses.replace(config.load, load_format=load_format, quantization=None, quant_spec=None)
    # the target's fp8 KV-cache scales (file, calculated) are its own layers': the draft keeps its checkpoint's
    cache = dataclasses.replace(config.cache, kv_scales=None, calculate_kv_scales=False)
    return dataclasses.replace(config, model=model, load=load, cache=cache, lora=LoRAConfig())


class DraftModelProposer(Proposer):
    """The draft model, its KV cache and its greedy proposals (see the module docstring)."""

    def __init__(self, config: AserveConfig, backend, device: torch.device):
        self.config = draft_model_config(config)
        self.k = config.speculative.num_speculative_tokens
        # Positions a proposal may reach: the draft's context and the target's max_model_len.
        self.max_len = min(self.config.model.arch.max_position_embeddings, config.model.max_model_len)
        self.device = device
        self.block_size = config.cache.block_size
        self.model = load_model(self.config, backend, device)
        self.kv_dtype = kv_cache_dtype_for(config)
        self.kv_caches: list[torch.Tensor] = []
        self.cpu_kv_caches: list[torch.Tensor] = []

    def kv_bytes_per_block(self) -> int:
        a = self.config.model.arch
        elem = torch.empty((), dtype=self.kv_dtype).element_size()
        return a.num_hidden_layers * 2 * self.block_size * a.num_key_value_heads * a.head_dim * elem

    def initialize_kv_cache(self, num_blocks: int, num_cpu_blocks: int) -> None:
        """Allocates the draft's cache with the target's block count (and CPU swap blocks)."""
        a = self.config.model.arch
        shape = (2, num_blocks, self.block_size, a.num_key_value_heads, a.head_dim)
        self.kv_caches = [zeroed(shape, self.kv_dtype, self.device) for _ in range(a.num_hidden_layers)]
        if num_cpu_blocks:
            self.cpu_kv_caches = [torch.empty((2, num_cpu_blocks) + shape[2:], dtype=self.kv_dtype,
                                              pin_memory=self.device.type == "cuda")
                                  for _ in range(a.num_hidden_layers)]
        self.model.bind_kv_caches(self.kv_caches)

    def catch_up(self, inputs: ModelInputs) -> None:
        """Runs the draft over the step's inputs (its K/V for every position the target computed that
        lies inside its context)."""
        positions, meta = inputs.positions, inputs.meta
        limit = self.config.model.arch.max_position_embeddings
        if meta.max_seq_len > limit:  # rows past the draft's context: no K/V written, positions clamped
            outside = positions >= limit
            meta = dataclasses.replace(meta, slot_mapping=meta.slot_mapping.masked_fill(outside, -1))
            positions = positions.clamp(max=limit - 1)
        self.model(inputs.input_ids, positions, meta)

    def propose(self, req_ids: list[str], states: dict[str, CachedRequestState], inputs=None) -> dict[str, list[int]]:
        """k greedy draft tokens for each request (its newest token is the first input) whose proposal
        positions stay inside both contexts; the others get none."""
        req_ids = [r for r in req_ids if states[r].num_tokens - 1 + self.k <= self.max_len]
        if not req_ids:
            return {}
        seqs = [states[r] for r in req_ids]
        tokens = [s.token_ids[-1] for s in seqs]
        positions = np.fromiter((s.num_tokens - 1 for s in seqs), dtype=np.int64, count=len(seqs))
        table = _block_table(seqs)
        drafts: list[list[int]] = [[] for _ in seqs]
        for _ in range(self.k):
            ids = torch.tensor(tokens, dtype=torch.int64, device=self.device)
            pos = torch.from_numpy(positions).to(self.device)
            hidden = self.model(ids, pos, _decode_meta(table, positions, self.block_size, self.device))
            greedy = self.model.greedy_tokens(hidden)  # (the head's greedy screen on CPU: the same argmax)
            tokens = greedy if greedy is not None else self.model.compute_logits(hidden).argmax(dim=-1).tolist()
            for d, t in zip(drafts, tokens):
                d.append(t)
            positions = positions + 1
        return dict(zip(req_ids, drafts))


def _block_table(seqs: list[CachedRequestState]) -> np.ndarray:
    width = max(len(s.block_ids) for s in seqs)
    table = np.zeros((len(seqs), width), dtype=np.int32)
    for i, s in enumerate(seqs):
        table[i, :len(s.block_ids)] = s.block_ids
    return table


def _decode_meta(table: np.ndarray, positions: np.ndarray, block_size: int, device: torch.device) -> AttentionMetadata:
    """One query token per sequence at `positions` (its K/V written there, attending to all before)."""
    n = len(positions)
    slots = table[np.arange(n), positions // block_size].astype(np.int64) * block_size + positions % block_size
    seq_lens = (positions + 1).astype(np.int32)
    starts = np.arange(n + 1, dtype=np.int32)
    return AttentionMetadata(
        num_tokens=n, num_seqs=n, num_decodes=n, num_decode_tokens=n,
        slot_mapping=torch.from_numpy(slots).to(device), query_start_loc=torch.from_numpy(starts).to(device),
        seq_lens=torch.from_numpy(seq_lens).to(device), block_tables=torch.from_numpy(table).to(device),
        max_query_len=1, max_seq_len=int(seq_lens.max()), query_start_loc_cpu=starts.tolist(),
        seq_lens_cpu=seq_lens.tolist())
