"""The device KV blocks: ref counts, a free queue in eviction order and the hash -> block map.

Block 0 is reserved as the null / padding block (the runner pads block tables with 0): it is never
handed out nor freed, so `num_free_blocks + num_used_blocks == num_blocks - 1`.

Eviction order: `allocate` takes blocks from the head of the free queue. A freed block without a
hash goes to the head (nothing is lost by reusing it); a freed cached block goes to the tail and
stays findable by hash until it is reallocated (LRU). Touching a cached free block takes it out of
the queue in O(1) (the queue is an OrderedDict). `num_cached_free_blocks` (free blocks still holding a
cached prefix) is kept as a running count, O(1) to read.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable

NULL_BLOCK_ID = 0


class BlockPool:
    """Ref-counted blocks `1..num_blocks-1`; with `enable_caching` freed full blocks stay cached."""

    def __init__(self, num_blocks: int, enable_caching: bool) -> None:
        if num_blocks < 2:
            raise ValueError(f"num_blocks: must be >= 2 (block 0 is reserved), got {num_blocks}")
        self.num_blocks = num_blocks
        self.enable_caching = enable_caching
        self._ref_cnts = [0] * num_blocks
        self._ref_cnts[NULL_BLOCK_ID] = 1  # never freed
        self._hashes: list[int | None] = [None] * num_blocks
        self._tokens: list[tuple[int, ...] | None] = [None] * num_blocks
        self._free: OrderedDict[int, None] = OrderedDict.fromkeys(range(1, num_blocks))
        self._cached: dict[int, int] = {}  # block hash -> block id
        self._num_cached_free = 0  # free blocks that still carry a hash

    # -- queries ---------------------------------------------------------------------------------
    @property
    def num_usable_blocks(self) -> int:
        return self.num_blocks - 1

    @property
    def num_free_blocks(self) -> int:
        """Blocks `allocate` can hand out (cached free blocks included: they are evicted on reuse)."""
        return len(self._free)

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - 1 - len(self._free)

    @property
    def num_cached_blocks(self) -> int:
        return len(self._cached)

    @property
    def num_cached_free_blocks(self) -> int:
        """Free blocks that still hold a cached prefix (reusable by a hit until evicted); a part of
        `num_free_blocks`."""
        return self._num_cached_free

    def ref_cnt(self, block_id: int) -> int:
        return self._ref_cnts[block_id]

    def block_hash(self, block_id: int) -> int | None:
        return self._hashes[block_id]

    def block_token_ids(self, block_id: int) -> tuple[int, ...] | None:
        return self._tokens[block_id]

    def is_free(self, block_id: int) -> bool:
        return block_id in self._free

    def get_cached_block(self, block_hash: int, token_ids: tuple[int, ...]) -> int | None:
        """The block cached under `block_hash` if its token ids equal `token_ids`, else None."""
        block_id = self._cached.get(block_hash)
        if block_id is None or self._tokens[block_id] != token_ids:
            return None
        return block_id

    # -- changes ---------------------------------------------------------------------------------
    def allocate(self, num_blocks: int) -> list[int] | None:
        """`num_blocks` blocks with ref count 1 from the head of the free queue; None if too few."""
        if num_blocks > len(self._free):
            return None
        free = self._free
        ref_cnts = self._ref_cnts
        hashes = self._hashes
        out = []
        for _ in range(num_blocks):
            block_id, _ = free.popitem(last=False)
            if hashes[block_id] is not None:
                self._num_cached_free -= 1
                self._evict(block_id)
            ref_cnts[block_id] = 1
            out.append(block_id)
        return out

    def touch(self, block_ids: Iterable[int]) -> None:
        """Takes one more reference to each block (a free cached block leaves the free queue)."""
        ref_cnts = self._ref_cnts
        for block_id in block_ids:
            if ref_cnts[block_id] == 0:
                del self._free[block_id]
                if self._hashes[block_id] is not None:
                    self._num_cached_free -= 1
            ref_cnts[block_id] += 1

    def free(self, block_ids: Iterable[int]) -> None:
        """Drops one reference to each block, in order; blocks reaching 0 join the free queue.

        Pass a block table reversed so that a sequence's tail blocks are evicted before its head.
        Raises AssertionError on a double free or on the null block.
        """
        ref_cnts = self._ref_cnts
        hashes = self._hashes
        free = self._free
        for block_id in block_ids:
            assert block_id != NULL_BLOCK_ID, "the null block cannot be freed"
            assert ref_cnts[block_id] > 0, f"double free of block {block_id}"
            ref_cnts[block_id] -= 1
            if ref_cnts[block_id] == 0:
                free[block_id] = None
                if hashes[block_id] is None:
                    free.move_to_end(block_id, last=False)
                elif not self.enable_caching:
                    self._evict(block_id)
                    free.move_to_end(block_id, last=False)
                else:
                    self._num_cached_free += 1

    def cache_full_block(self, block_id: int, block_hash: int, token_ids: tuple[int, ...]) -> bool:
        """Registers a full block under `block_hash`; False (nothing changes) when the block already
        has a hash or another block holds that hash."""
        if self._hashes[block_id] is not None or block_hash in self._cached:
            return False
        assert self._ref_cnts[block_id] > 0, f"caching free block {block_id}"
        self._hashes[block_id] = block_hash
        self._tokens[block_id] = token_ids
        self._cached[block_hash] = block_id
        return True

    def uncache_block(self, block_id: int) -> None:
        """Forgets the block's hash (its content is no longer trusted); no-op for an uncached block."""
        if self._hashes[block_id] is not None:
            self._evict(block_id)
            if block_id in self._free:
                self._num_cached_free -= 1
                self._free.move_to_end(block_id, last=False)

    def reset_prefix_cache(self) -> bool:
        """Forgets every hash; only when no block is in use (returns False and changes nothing otherwise)."""
        if self.num_used_blocks:
            return False
        for block_id in self._cached.values():
            self._hashes[block_id] = None
            self._tokens[block_id] = None
        self._cached.clear()
        self._num_cached_free = 0
        return True

    def _evict(self, block_id: int) -> None:
        block_hash = self._hashes[block_id]
        if self._cached.get(block_hash) == block_id:
            del self._cached[block_hash]
        self._hashes[block_id] = None
        self._tokens[block_id] = None
