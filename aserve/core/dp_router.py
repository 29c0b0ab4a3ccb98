"""Which data-parallel replica serves a request (`--data-parallel-size N`). Pure Python, no torch.

Load balancing as vLLM's: the replica with the fewest unfinished requests, ties broken by fewer
queued prompt tokens, then by index. Beyond vLLM, prefix-cache-aware: the router remembers which
replica it sent each full prompt block to (chained block hashes, as the prefix cache keys them; a
bounded LRU map), and a request whose prompt starts with blocks a replica was sent before goes to
the replica holding its longest such prefix, unless that replica is over its fair share of the
load: more than `fair * (1 + imbalance) + 1` unfinished requests, `fair` being the mean over
replicas with this request counted. The map is a hint (a replica may have evicted the blocks since);
it never changes what a request computes, only where.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

from aserve.core.hashing import BlockHash, extend_block_hashes


@dataclass(frozen=True)
class ReplicaLoad:
    num_unfinished: int  # requests waiting, running or swapped
    num_queued_prompt_tokens: int  # their prompt tokens not yet computed


class LeastLoadedRouter:
    """vLLM's rule alone (no prefix affinity)."""

    def route(self, prompt_token_ids: Sequence[int], loads: Sequence[ReplicaLoad]) -> int:
        return least_loaded(loads)


class PrefixAwareRouter:
    """Least-loaded routing with prefix affinity (module docstring). Not thread-safe (the event loop's)."""

    def __init__(self, block_size: int, max_blocks: int = 1 << 16, imbalance: float = 0.5):
        self.block_size = block_size
        self.max_blocks = max_blocks
        self.imbalance = imbalance
        self._owner: OrderedDict[BlockHash, int] = OrderedDict()  # block hash -> replica, LRU order

    def route(self, prompt_token_ids: Sequence[int], loads: Sequence[ReplicaLoad]) -> int:
        """The replica for a request with this prompt; remembers its blocks as that replica's."""
        hashes: list[BlockHash] = []
        extend_block_hashes(hashes, prompt_token_ids, self.block_size)
        choice = self._affine(hashes, loads)
        if choice is None:
            choice = least_loaded(loads)
        owner = self._owner
        for h in hashes:
            owner[h] = choice
            owner.move_to_end(h)
        while len(owner) > self.max_blocks:
            owner.popitem(last=False)
        return choice

    def _affine(self, hashes: list[BlockHash], loads: Sequence[ReplicaLoad]) -> int | None:
        """The replica holding the longest prefix of `hashes`, if it is within its fair share."""
        for h in reversed(hashes):
            replica = self._owner.get(h)
            if replica is None or replica >= len(loads):
                continue
            fair = (sum(load.num_unfinished for load in loads) + 1) / len(loads)
            if loads[replica].num_unfinished + 1 <= fair * (1 + self.imbalance) + 1:
                return replica
            return None
        return None


def least_loaded(loads: Sequence[ReplicaLoad]) -> int:
    """Fewest unfinished requests, then fewest queued prompt tokens, then lowest index."""
    return min(range(len(loads)), key=lambda i: (loads[i].num_unfinished, loads[i].num_queued_prompt_tokens, i))
