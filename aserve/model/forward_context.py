"""The scoped per-step forward context: what layers read about the current step without it being
threaded through every `forward` signature.

The runner wraps each step's model forward (and each CUDA-graph capture) in
`with set_forward_context(ForwardContext(lora=mapping)): ...`; a layer calls `get_forward_context()`.
The context lives in a `contextvars.ContextVar`, so it is per thread (the runner's executor thread)
and per task, and it is reset when the `with` block exits: nothing outlives the step. Outside any
`with`, `get_forward_context()` is an empty context (no LoRA: every layer computes its base result).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from aserve.model.lora.mapping import LoRABatchMapping


@dataclass(frozen=True)
class ForwardContext:
    """Per-step data layers read. `lora`: the step's token -> LoRA slot mapping (None: no token of
    this step uses an adapter)."""

    lora: LoRABatchMapping | None = None


_EMPTY = ForwardContext()
_CURRENT: ContextVar[ForwardContext] = ContextVar("aserve_forward_context", default=_EMPTY)


@contextmanager
def set_forward_context(ctx: ForwardContext) -> Iterator[ForwardContext]:
    """Make `ctx` the current forward context inside the `with` block (nesting allowed; the previous
    context is restored on exit, exceptions included)."""
    token = _CURRENT.set(ctx)
    try:
        yield ctx
    finally:
        _CURRENT.reset(token)


def get_forward_context() -> ForwardContext:
    """The context the innermost `set_forward_context` set, or an empty `ForwardContext()`."""
    return _CURRENT.get()
