"""Chained block hashes for prefix caching.

A full block's hash covers its parent's hash, its token ids and optional extra keys (for example an
adapter id), so equal hashes mean equal prefixes up to hash collisions. Callers that look a hash up
must still compare the block's token ids (the block pool does).

The hash function is injected (default: Python's built-in `hash` over a tuple; fast, stable within
one process, which is all the prefix cache needs).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

BlockHash = int
HashFn = Callable[[Any], int]

# The parent hash of a sequence's first block.
ROOT_PARENT_HASH: BlockHash = 0


def extend_block_hashes(
    block_hashes: list[BlockHash],
    token_ids: Sequence[int],
    block_size: int,
    extra_keys: tuple[Any, ...] | None = None,
    hash_fn: HashFn = hash,
) -> None:
    """Appends to `block_hashes` (in place) the hashes of the full blocks of `token_ids` it lacks.

    `block_hashes` must hold the hashes of the first `len(block_hashes)` blocks of `token_ids`.
    """
    num_full = len(token_ids) // block_size
    i = len(block_hashes)
    parent = block_hashes[-1] if block_hashes else ROOT_PARENT_HASH
    while i < num_full:
        start = i * block_size
        parent = hash_fn((parent, tuple(token_ids[start:start + block_size]), extra_keys))
        block_hashes.append(parent)
        i += 1
