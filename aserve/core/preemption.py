"""Which running request gives up its KV blocks when a running request cannot get any."""

from __future__ import annotations

from collections import Counter

from aserve.core.request import Request


def victim_index(running: list[Request], priority_policy: bool) -> int:
    """The index in `running` (not empty) of the request to preempt, for recompute and swap alike.

    fcfs: the request latest in `running` (latest admitted) of the client (`client_id`) holding the
    most running requests, so a client flooding the batch gives up its memory before another client's
    request is touched; between clients with equal counts, the one owning the request latest in
    `running`. With a single client this is the last running request. priority: explicit priorities
    decide, clients do not: the largest `priority` value, then the latest arrival, then the latest in
    `running`. O(len(running)).
    """
    if priority_policy:
        return max(range(len(running)), key=lambda j: (running[j].priority, running[j].arrival_time, j))
    num_running = Counter(req.client_id for req in running)
    most = max(num_running.values())
    return next(j for j in range(len(running) - 1, -1, -1) if num_running[running[j].client_id] == most)
