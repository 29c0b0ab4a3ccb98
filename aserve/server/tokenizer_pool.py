"""The server's tokenizer pool (vLLM's `--tokenizer-pool-size`): tokenizing and chat-template rendering
run on worker threads, each with its own tokenizer copy and renderer, so several long prompts are
tokenized at once instead of queueing behind one another (Hugging Face's fast tokenizers release the
GIL while they encode, and one tokenizer object must not be used by two threads at once).

Size 0 (the default, as vLLM) or 1 keeps one worker: the loaded tokenizer itself. Size N > 1 uses N
deep copies (the loaded one stays free for the quick decodes the event loop does itself). The pool only serves the HTTP server; the offline `LLM` tokenizes
on its caller's thread.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TypeVar

import anyio

T = TypeVar("T")


@dataclass
class TokenizerWorker:
    """What one worker thread uses: its own tokenizer and the renderer over it."""

    tokenizer: Any
    renderer: Any


class TokenizerPool:
    def __init__(self, tokenizer: Any, make_renderer: Callable[[Any], Any], size: int):
        """`make_renderer(tokenizer)` builds a renderer over a tokenizer (copies get their own)."""
        self.size = max(size, 1)
        tokenizers = [tokenizer] if self.size == 1 else [copy.deepcopy(tokenizer) for _ in range(self.size)]
        self._free = [TokenizerWorker(tok, make_renderer(tok)) for tok in tokenizers]
        self._limiter: anyio.CapacityLimiter | None = None  # made on the event loop, at first use

    async def run(self, fn: Callable[[TokenizerWorker], T]) -> T:
        """`fn(worker)` on a worker thread with a worker no other thread is using."""
        if self._limiter is None:
            self._limiter = anyio.CapacityLimiter(self.size)
        async with self._limiter:
            worker = self._free.pop()
            try:
                return await anyio.to_thread.run_sync(fn, worker)
            finally:
                self._free.append(worker)
