import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from aserve.core.block_pool import BlockPool


def test_block_zero_is_reserved():
    pool = BlockPool(4, enable_caching=True)
    assert pool.num_free_blocks == 3
    assert sorted(pool.allocate(3)) == [1, 2, 3]
    assert pool.allocate(1) is None
    with pytest.raises(AssertionError):
        pool.free([0])
    with pytest.raises(ValueError, match="num_blocks"):
        BlockPool(1, enable_caching=False)


def test_allocate_all_or_nothing_and_double_free():
    pool = BlockPool(5, enable_caching=False)
    assert pool.allocate(5) is None and pool.num_free_blocks == 4
    blocks = pool.allocate(2)
    assert pool.num_used_blocks == 2
    pool.free(blocks)
    assert pool.num_free_blocks == 4
    with pytest.raises(AssertionError, match="double free"):
        pool.free(blocks[:1])


def test_cached_free_blocks_stay_findable_and_are_evicted_lru():
    pool = BlockPool(5, enable_caching=True)
    a, b = pool.allocate(2)
    pool.cache_full_block(a, 111, (1, 2))
    pool.cache_full_block(b, 222, (3, 4))
    pool.free([b, a])  # a table freed in reverse: its tail (b) is evicted first
    assert pool.num_free_blocks == 4
    assert pool.get_cached_block(111, (1, 2)) == a
    assert pool.get_cached_block(111, (1, 3)) is None  # a hash hit still compares tokens
    # The two never-used blocks go first, then b (older in the queue), then a.
    first = pool.allocate(2)
    assert a not in first and b not in first
    assert pool.allocate(1) == [b]
    assert pool.get_cached_block(222, (3, 4)) is None  # evicted on reuse
    assert pool.get_cached_block(111, (1, 2)) == a


def test_touch_revives_a_free_cached_block():
    pool = BlockPool(3, enable_caching=True)
    (a,) = pool.allocate(1)
    pool.cache_full_block(a, 7, (0,))
    pool.free([a])
    pool.touch([a])
    assert pool.ref_cnt(a) == 1 and not pool.is_free(a) and pool.num_free_blocks == 1
    pool.touch([a])
    assert pool.ref_cnt(a) == 2
    pool.free([a])
    pool.free([a])
    assert pool.get_cached_block(7, (0,)) == a


def test_freed_uncached_blocks_are_reused_before_cached_ones():
    pool = BlockPool(4, enable_caching=True)
    a, b, _ = pool.allocate(3)
    pool.cache_full_block(a, 1, (1,))
    pool.free([a])
    pool.free([b])  # no hash: goes to the head
    assert pool.allocate(1) == [b]


def test_without_caching_a_freed_block_drops_its_hash():
    pool = BlockPool(3, enable_caching=False)
    (a,) = pool.allocate(1)
    assert pool.cache_full_block(a, 5, (9,))
    assert pool.get_cached_block(5, (9,)) == a  # live blocks are shareable (n > 1 samples)
    pool.free([a])
    assert pool.get_cached_block(5, (9,)) is None and pool.block_hash(a) is None


def test_a_hash_is_held_by_one_block():
    pool = BlockPool(4, enable_caching=True)
    a, b = pool.allocate(2)
    assert pool.cache_full_block(a, 5, (1,))
    assert not pool.cache_full_block(b, 5, (1,))
    assert not pool.cache_full_block(a, 6, (2,))  # already has a hash
    assert pool.block_hash(b) is None and pool.get_cached_block(5, (1,)) == a


def test_reset_prefix_cache_only_when_idle():
    pool = BlockPool(3, enable_caching=True)
    (a,) = pool.allocate(1)
    pool.cache_full_block(a, 5, (1,))
    assert not pool.reset_prefix_cache()
    pool.free([a])
    assert pool.reset_prefix_cache()
    assert pool.get_cached_block(5, (1,)) is None and pool.num_cached_blocks == 0


@settings(max_examples=60, deadline=None)
@given(st.booleans(), st.lists(st.tuples(st.sampled_from(["alloc", "free", "cache", "touch", "lookup"]),
                                         st.integers(0, 5), st.integers(0, 3)), max_size=60))
def test_random_operations_keep_the_pool_consistent(enable_caching, ops):
    num_blocks = 9
    pool = BlockPool(num_blocks, enable_caching)
    holders: list[list[int]] = []  # each "table" holds one reference per block in it
    for op, n, key in ops:
        if op == "alloc":
            got = pool.allocate(n)
            if got is None:
                assert n > pool.num_free_blocks
            else:
                assert len(set(got)) == n and 0 not in got
                holders.append(got)
        elif op == "free" and holders:
            pool.free(reversed(holders.pop(n % len(holders))))
        elif op == "cache" and holders:
            table = holders[n % len(holders)]
            if table:
                block = table[0]
                pool.cache_full_block(block, key, (key, key))
        elif op == "touch":
            block = pool.get_cached_block(key, (key, key))
            if block is not None:
                pool.touch([block])
                holders.append([block])
        elif op == "lookup":
            block = pool.get_cached_block(key, (key, key))
            if block is not None:
                assert pool.block_token_ids(block) == (key, key)
        # invariants
        counts = [0] * num_blocks
        for table in holders:
            for b in table:
                counts[b] += 1
        for b in range(1, num_blocks):
            assert pool.ref_cnt(b) == counts[b]
            assert pool.is_free(b) == (counts[b] == 0)
            if not enable_caching and counts[b] == 0:
                assert pool.block_hash(b) is None
        assert pool.num_free_blocks + pool.num_used_blocks == num_blocks - 1


def test_num_cached_free_blocks_matches_a_recount_over_random_operations():
    """The running count equals the free blocks that carry a hash, whatever the sequence of
    allocate / touch / free / cache / uncache / reset."""
    import random

    rng = random.Random(0)
    pool = BlockPool(12, enable_caching=True)
    held: list[int] = []
    next_hash = 0

    def recount() -> int:
        return sum(1 for b in range(1, 12) if pool.is_free(b) and pool.block_hash(b) is not None)

    for _ in range(2000):
        op = rng.randrange(6)
        if op == 0:
            got = pool.allocate(rng.randint(1, 3))
            held += got or []
        elif op == 1 and held:
            pool.free([held.pop(rng.randrange(len(held)))])
        elif op == 2 and held:
            block = rng.choice(held)
            next_hash += 1
            pool.cache_full_block(block, next_hash, (next_hash,))
        elif op == 3:
            cached_free = [b for b in range(1, 12) if pool.is_free(b) and pool.block_hash(b) is not None]
            if cached_free:
                block = rng.choice(cached_free)
                pool.touch([block])
                held.append(block)
        elif op == 4:
            pool.uncache_block(rng.randrange(1, 12))
        elif op == 5 and rng.random() < 0.05:
            pool.reset_prefix_cache()
        assert pool.num_cached_free_blocks == recount()
    assert pool.num_cached_free_blocks <= pool.num_free_blocks
