"""User logits processors: how to call one (its signature, read once) and running them per row.

A processor is `f(output_token_ids, logits_row) -> logits_row` or
`f(prompt_token_ids, output_token_ids, logits_row) -> logits_row`; it may edit the row in place or
return a new tensor of the same shape. A processor belongs to one request: whatever it does wrong
(raises, returns something else) fails that row alone, reported by position, never raised.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from aserve.runner.sampling.state import RequestSampling


def processor_arity(fn: Callable[..., Any]) -> int:
    """How many positional arguments `fn` is called with (2 or 3); raises ValueError if neither fits."""
    try:
        sig = inspect.signature(fn)
    except (TypeError, ValueError) as e:
        raise ValueError(f"logits_processors: cannot inspect the signature of {fn!r}") from e
    params = list(sig.parameters.values())
    if any(p.kind == inspect.Parameter.VAR_POSITIONAL for p in params):
        return 3
    positional = [p for p in params
                  if p.kind in (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)]
    required = [p for p in positional if p.default is inspect.Parameter.empty]
    for n in (len(required), len(positional)):
        if n in (2, 3):
            return n
    raise ValueError(f"logits_processors: {fn!r} must take (output_token_ids, logits) or "
                     f"(prompt_token_ids, output_token_ids, logits), it takes {len(positional)} arguments")


def apply_processors(work: torch.Tensor, rows: list[RequestSampling]) -> dict[int, str]:
    """Runs each row's processors on its row of `work [B, V]` (float32, edited in place). Returns
    {row position: why} for the rows whose processor failed; their rows of `work` are then undefined."""
    failed: dict[int, str] = {}
    for i, row in enumerate(rows):
        if not row.processors:
            continue
        view = work[i]
        prompt_ids = row.token_ids[:row.num_prompt_tokens]
        output_ids = row.token_ids[row.num_prompt_tokens:]
        for fn, arity in row.processors:
            try:
                new = fn(output_ids, view) if arity == 2 else fn(prompt_ids, output_ids, view)
                if not isinstance(new, torch.Tensor) or new.shape != view.shape:
                    failed[i] = (f"logits_processors: {_name(fn)} must return the logits row (a tensor of "
                                 f"shape {tuple(view.shape)}), got {type(new).__name__}")
                elif new.data_ptr() != view.data_ptr():
                    view.copy_(new)
            except Exception as e:  # noqa: BLE001 - the processor is user code; it fails its request only
                failed[i] = f"logits_processors: {_name(fn)} raised {type(e).__name__}: {e}"
            if i in failed:
                break
    return failed


def _name(fn: Callable[..., Any]) -> str:
    return getattr(fn, "__qualname__", None) or repr(fn)
