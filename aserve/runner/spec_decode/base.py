"""What the runner calls on a draft proposer; the defaults suit a proposer with no model (n-gram)."""

from __future__ import annotations

import torch


class Proposer:
    """A draft proposer as the runner drives it: sized and allocated with the KV cache, run after each
    forward pass (`catch_up`), asked for drafts after sampling (`propose`)."""

    kv_caches: list[torch.Tensor] = []  # a draft model's KV cache (target block layout), else none
    cpu_kv_caches: list[torch.Tensor] = []

    def kv_bytes_per_block(self) -> int:
        """Bytes a draft model's cache adds to each KV block (the runner sizes blocks with it)."""
        return 0

    def initialize_kv_cache(self, num_blocks: int, num_cpu_blocks: int) -> None:
        """Allocates the proposer's cache once the block counts are known."""

    def catch_up(self, inputs) -> None:
        """Runs over the step's model inputs after the target (a draft model keeps its cache complete)."""

    def propose(self, req_ids: list[str], states: dict, inputs=None) -> dict[str, list[int]]:
        """req_id -> drafts for the requests that sampled this step (their token_ids hold this step's tokens)."""
        raise NotImplementedError
