"""Fair sharing of the batch between clients (API keys): the waiting queue of the fcfs policy.

Each request may name a `client_id` (the server passes a hash of the API key; None is a client like
any other). Requests of one client stay in arrival order; between clients, the next request comes
from the client with the fewest running requests (samples of an n > 1 request count one each), ties
going to the client whose head request arrived first. So a client with 200 requests waiting cannot
starve another: the other's request is admitted as soon as a step has room for one. With a single
client the queue is exactly first-come, first-served (preempted requests go back to the front).
Preemption mirrors this: the scheduler takes memory back from the client with the most running
requests first (`core/preemption.py`).

The scheduler calls `start_step(running)` before admitting requests, so the running counts are the
batch's; `pop()` counts the popped request as running for the rest of the step.
"""

from __future__ import annotations

import itertools
from collections import Counter, deque
from collections.abc import Iterator

from aserve.core.request import Request


class FairQueue:
    """Per-client arrival order; the next request is the head of the least-served client's queue."""

    def __init__(self) -> None:
        self._queues: dict[str | None, deque[tuple[int, Request]]] = {}
        self._running: Counter[str | None] = Counter()
        self._next_seq = itertools.count()  # arrival order
        self._front_seq = itertools.count(-1, -1)  # requests put back in front come before any arrival
        self._len = 0

    def start_step(self, running: list[Request]) -> None:
        """Counts `running` (the batch at the start of the step) per client."""
        self._running = Counter(req.client_id for req in running)

    def add(self, req: Request) -> None:
        self._queues.setdefault(req.client_id, deque()).append((next(self._next_seq), req))
        self._len += 1

    def add_front(self, req: Request) -> None:
        self._queues.setdefault(req.client_id, deque()).appendleft((next(self._front_seq), req))
        self._len += 1

    def add_front_all(self, reqs: list[Request]) -> None:
        """Puts back, in front and in their order, requests popped this step but not admitted (they no
        longer count as running)."""
        for req in reversed(reqs):
            self._running[req.client_id] -= 1
            self.add_front(req)

    def _next_client(self) -> str | None:
        running = self._running
        return min(self._queues, key=lambda c: (running[c], self._queues[c][0][0]))

    def peek(self) -> Request:
        if not self._len:
            raise IndexError("peek from an empty queue")
        return self._queues[self._next_client()][0][1]

    def pop(self) -> Request:
        if not self._len:
            raise IndexError("pop from an empty queue")
        client = self._next_client()
        queue = self._queues[client]
        req = queue.popleft()[1]
        if not queue:
            del self._queues[client]
        self._running[client] += 1
        self._len -= 1
        return req

    def remove(self, req: Request) -> None:
        queue = self._queues.get(req.client_id)
        for i, (_, queued) in enumerate(queue or ()):
            if queued is req:
                del queue[i]
                if not queue:
                    del self._queues[req.client_id]
                self._len -= 1
                return
        raise ValueError(f"{req.request_id!r} not queued")

    def __len__(self) -> int:
        return self._len

    def __iter__(self) -> Iterator[Request]:
        """Every queued request, in arrival order (put-back requests first); not the pick order."""
        entries = sorted((entry for queue in self._queues.values() for entry in queue), key=lambda e: e[0])
        return (req for _, req in entries)
