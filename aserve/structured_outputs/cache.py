"""`SpecCache`: an LRU of compiled grammars keyed by spec, shared by the grammar backends.

Thread-safe: concurrent requests for one key wait for a single compilation; a failed
compilation is not cached (the error reaches every waiter, the next request retries).
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Callable, Hashable
from concurrent.futures import Future
from typing import Any


class SpecCache:
    """Keeps the last `max_entries` results of `get_or_compile`; no global state."""

    def __init__(self, max_entries: int = 256):
        self.max_entries = max_entries
        self._lock = threading.Lock()
        self._entries: OrderedDict[Hashable, Future] = OrderedDict()

    def __len__(self) -> int:
        with self._lock:
            return sum(1 for f in self._entries.values() if f.done())

    def get_or_compile(self, key: Hashable, compile_fn: Callable[[], Any]) -> Any:
        """The cached value for `key`, else `compile_fn()` (run once per key at a time, in the
        calling thread). Exceptions from `compile_fn` propagate and are not cached."""
        with self._lock:
            future = self._entries.get(key)
            owner = future is None
            if owner:
                future = self._entries[key] = Future()
            else:
                self._entries.move_to_end(key)
        if owner:
            try:
                future.set_result(compile_fn())
            except BaseException as e:
                with self._lock:
                    if self._entries.get(key) is future:
                        del self._entries[key]
                future.set_exception(e)
                raise
            self._evict()
        return future.result()

    def _evict(self) -> None:
        with self._lock:
            while len(self._entries) > self.max_entries:
                oldest = next(iter(self._entries))
                if not self._entries[oldest].done():
                    break
                del self._entries[oldest]
