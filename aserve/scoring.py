"""Scoring text pairs (vLLM's `LLM.score` and `/score`, `/rerank`): how `text_1` and `text_2` pair up,
and the cosine similarity that scores a pair with an embedding model. Standard library only, so the
offline API and the torch-free server share it."""

from __future__ import annotations

import math
from collections.abc import Sequence


def score_pairs(text_1: str | Sequence[str], text_2: str | Sequence[str]) -> list[tuple[str, str]]:
    """The pairs to score: one `text_1` against one or many `text_2` (one-to-one, one-to-many), or two
    lists of equal length pairwise. ValueError naming the field otherwise (empty lists included)."""
    firsts = [text_1] if isinstance(text_1, str) else list(text_1)
    seconds = [text_2] if isinstance(text_2, str) else list(text_2)
    if not firsts:
        raise ValueError("text_1: must not be empty")
    if not seconds:
        raise ValueError("text_2: must not be empty")
    if len(firsts) == 1:
        return [(firsts[0], t) for t in seconds]
    if len(firsts) != len(seconds):
        raise ValueError(f"text_2: a list of {len(firsts)} text_1 inputs pairs with as many text_2 inputs "
                         f"(or give one text_1), got {len(seconds)}")
    return list(zip(firsts, seconds))


def cosine_similarity(a: Sequence[float], b: Sequence[float]) -> float:
    """cos(a, b); 0.0 when either vector is zero."""
    dot = sum(x * y for x, y in zip(a, b))
    norm = math.sqrt(sum(x * x for x in a)) * math.sqrt(sum(y * y for y in b))
    return dot / norm if norm else 0.0
