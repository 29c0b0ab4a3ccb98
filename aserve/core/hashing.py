"""Chained block hashes for prefix caching.

A full block's hash covers its parent's hash, its token ids and optional extra keys (for example an
adapter id), so equal hashes mean equal prefixes up to hash collisions. Callers that look a hash up
must still compare the block's token ids (the block pool does).

The hash function is injected: `hash` (Python's built-in over a tuple; fast, stable within one
process) or `sha256_hash` (collision resistant, stable across processes).
"""

from __future__ import annotations

import hashlib
import pickle
from collections.abc import Callable, Sequence
from typing import Any

BlockHash = int
HashFn = Callable[[Any], int]

# The parent hash of a sequence's first block.
ROOT_PARENT_HASH: BlockHash = 0


def sha256_hash(obj: Any) -> int:
    """A 128-bit int from SHA-256 over the pickled object (ints, tuples, None, str)."""
    digest = hashlib.sha256(pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)).digest()
    return int.from_bytes(digest[:16], "big")


_HASH_FNS: dict[str, HashFn] = {"builtin": hash, "sha256": sha256_hash}


def get_hash_fn(name: str) -> HashFn:
    """The hash function called `name` ("builtin" or "sha256"); ValueError otherwise."""
    try:
        return _HASH_FNS[name]
    except KeyError:
        raise ValueError(f"hash_fn: must be one of {sorted(_HASH_FNS)}, got {name!r}") from None


def hash_block_tokens(
    parent_hash: BlockHash | None,
    token_ids: Sequence[int],
    extra_keys: tuple[Any, ...] | None = None,
    hash_fn: HashFn = hash,
) -> BlockHash:
    """The hash of one full block chained to `parent_hash` (None or ROOT_PARENT_HASH for the first)."""
    if parent_hash is None:
        parent_hash = ROOT_PARENT_HASH
    return hash_fn((parent_hash, tuple(token_ids), extra_keys))


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


def hash_request_blocks(
    token_ids: Sequence[int],
    block_size: int,
    start_hashes: Sequence[BlockHash] = (),
    extra_keys: tuple[Any, ...] | None = None,
    hash_fn: HashFn = hash,
) -> list[BlockHash]:
    """Hashes of all full blocks of `token_ids`; `start_hashes` (the first blocks' hashes) are reused."""
    if block_size < 1:
        raise ValueError(f"block_size: must be >= 1, got {block_size}")
    hashes = list(start_hashes)
    if len(hashes) > len(token_ids) // block_size:
        raise ValueError(f"start_hashes: {len(hashes)} hashes for only {len(token_ids) // block_size} full blocks")
    extend_block_hashes(hashes, token_ids, block_size, extra_keys, hash_fn)
    return hashes
