"""Data-parallel routing (core/dp_router.py): least loaded as vLLM, and prefix affinity that beats
round-robin's prefix-cache hit rate on a shared-prefix workload without overloading a replica."""

from __future__ import annotations

import random
from collections import OrderedDict

from aserve.core.dp_router import LeastLoadedRouter, PrefixAwareRouter, ReplicaLoad, least_loaded
from aserve.core.hashing import extend_block_hashes

BS = 4


def test_least_loaded_breaks_ties_by_queued_prompt_tokens_then_index():
    assert least_loaded([ReplicaLoad(3, 0), ReplicaLoad(1, 500), ReplicaLoad(2, 0)]) == 1
    assert least_loaded([ReplicaLoad(1, 90), ReplicaLoad(1, 10), ReplicaLoad(1, 10)]) == 1
    assert LeastLoadedRouter().route([1, 2, 3], [ReplicaLoad(0, 0), ReplicaLoad(0, 0)]) == 0


def test_a_shared_prefix_follows_its_replica_until_it_is_over_its_fair_share():
    router = PrefixAwareRouter(BS)
    prefix = list(range(100, 116))  # four full blocks
    idle = [ReplicaLoad(0, 0), ReplicaLoad(0, 0)]
    first = router.route(prefix + [1, 2], idle)
    assert first == 0
    # replica 0 is busier, but within its share: the prefix's replica wins over the least loaded one
    loads = [ReplicaLoad(2, 40), ReplicaLoad(1, 0)]
    assert router.route(prefix + [7, 8, 9], loads) == 0
    assert router.route(list(range(500, 520)), loads) == 1  # no known prefix: least loaded
    # far over its share (fair = 10.5 of 21): affinity yields to balance
    assert router.route(prefix + [3], [ReplicaLoad(20, 0), ReplicaLoad(0, 0)]) == 1
    # and the prefix now also belongs to replica 1 (the latest owner)
    assert router.route(prefix + [4], [ReplicaLoad(1, 0), ReplicaLoad(1, 0)]) == 1


def test_the_prefix_map_is_bounded():
    router = PrefixAwareRouter(BS, max_blocks=8)
    for i in range(20):
        router.route(list(range(i * 100, i * 100 + 16)), [ReplicaLoad(0, 0), ReplicaLoad(0, 0)])
    assert len(router._owner) == 8


def _hit_rate(router, num_replicas: int = 2, seed: int = 0, capacity: int = 80) -> float:
    """A shared-prefix workload (8 system prompts of 64 tokens, 400 requests arriving interleaved, each
    running for a few arrivals): the fraction of prompt blocks found in the chosen replica's prefix
    cache (LRU, `capacity` blocks: about five prompts' worth, so no replica holds every prefix)."""
    rng = random.Random(seed)
    prefixes = [[rng.randrange(1000) for _ in range(64)] for _ in range(8)]
    caches = [OrderedDict() for _ in range(num_replicas)]
    running: list[tuple[int, int]] = []  # (replica, finishes at arrival index)
    hits = total = 0
    for t in range(400):
        running = [(r, end) for r, end in running if end > t]
        loads = [ReplicaLoad(sum(1 for r, _ in running if r == i), 0) for i in range(num_replicas)]
        prompt = prefixes[rng.randrange(8)] + [rng.randrange(1000) for _ in range(rng.randrange(4, 24))]
        replica = router.route(prompt, loads)
        hashes: list[int] = []
        extend_block_hashes(hashes, prompt, BS)
        cache = caches[replica]
        hits += sum(1 for h in hashes if h in cache)
        total += len(hashes)
        for h in hashes:
            cache[h] = True
            cache.move_to_end(h)
        while len(cache) > capacity:
            cache.popitem(last=False)
        running.append((replica, t + rng.randrange(2, 8)))
    return hits / total


class RoundRobin:
    def __init__(self):
        self.next = 0

    def route(self, prompt, loads):
        self.next = (self.next + 1) % len(loads)
        return self.next


def test_prefix_aware_routing_beats_round_robin_hit_rate():
    aware, rr = _hit_rate(PrefixAwareRouter(BS)), _hit_rate(RoundRobin())
    least = _hit_rate(LeastLoadedRouter())
    assert aware > rr + 0.05 and aware > least + 0.05, (aware, rr, least)
