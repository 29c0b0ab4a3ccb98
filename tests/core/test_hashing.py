from hypothesis import given
from hypothesis import strategies as st

from aserve.core.hashing import ROOT_PARENT_HASH, extend_block_hashes


def _hashes(tokens, block_size, extra_keys=None, hash_fn=hash):
    out: list[int] = []
    extend_block_hashes(out, tokens, block_size, extra_keys, hash_fn)
    return out


def test_only_full_blocks_are_hashed_and_chained_to_their_parent():
    hashes = _hashes(list(range(11)), 4)
    assert len(hashes) == 2
    assert hashes[0] == hash((ROOT_PARENT_HASH, (0, 1, 2, 3), None))
    assert hashes[1] == hash((hashes[0], (4, 5, 6, 7), None))


def test_extra_keys_and_the_hash_function_take_part():
    assert _hashes([1, 2, 3, 4], 4, ("lora-a",)) != _hashes([1, 2, 3, 4], 4, ("lora-b",))
    seen = []
    _hashes([1, 2, 3, 4, 5, 6, 7, 8], 4, hash_fn=lambda key: seen.append(key) or len(seen))
    assert seen == [(ROOT_PARENT_HASH, (1, 2, 3, 4), None), (1, (5, 6, 7, 8), None)]


def test_incremental_extension_matches_hashing_all_at_once():
    tokens = list(range(20))
    full = _hashes(tokens, 4)
    hashes: list[int] = []
    for n in range(len(tokens) + 1):
        extend_block_hashes(hashes, tokens[:n], 4)
        assert hashes == full[: n // 4]
    trusted = [123]
    extend_block_hashes(trusted, tokens, 4)  # existing hashes are trusted, not recomputed
    assert trusted[0] == 123 and trusted[1] == hash((123, (4, 5, 6, 7), None))


@given(st.lists(st.integers(0, 3), max_size=40), st.lists(st.integers(0, 3), max_size=40), st.sampled_from([1, 2, 4]))
def test_equal_hash_chains_iff_equal_prefix_blocks(a, b, block_size):
    ha, hb = _hashes(a, block_size), _hashes(b, block_size)
    for i in range(min(len(ha), len(hb))):
        same = a[: (i + 1) * block_size] == b[: (i + 1) * block_size]
        assert (ha[i] == hb[i]) == same
