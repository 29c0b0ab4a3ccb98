import pytest
from hypothesis import given
from hypothesis import strategies as st

from aserve.core.hashing import (
    ROOT_PARENT_HASH,
    extend_block_hashes,
    get_hash_fn,
    hash_block_tokens,
    hash_request_blocks,
    sha256_hash,
)


def test_chain_depends_on_parent_tokens_and_extra_keys():
    h1 = hash_block_tokens(None, [1, 2, 3, 4])
    assert h1 == hash_block_tokens(ROOT_PARENT_HASH, (1, 2, 3, 4))
    assert hash_block_tokens(h1, [5, 6, 7, 8]) != hash_block_tokens(h1 + 1, [5, 6, 7, 8])
    assert hash_block_tokens(h1, [5, 6, 7, 8]) != hash_block_tokens(h1, [5, 6, 7, 9])
    assert hash_block_tokens(h1, [5, 6, 7, 8], ("lora-a",)) != hash_block_tokens(h1, [5, 6, 7, 8], ("lora-b",))


def test_only_full_blocks_are_hashed():
    hashes = hash_request_blocks(list(range(11)), 4)
    assert len(hashes) == 2
    assert hashes[0] == hash_block_tokens(None, [0, 1, 2, 3])
    assert hashes[1] == hash_block_tokens(hashes[0], [4, 5, 6, 7])


def test_incremental_matches_full_and_reuses_start_hashes():
    tokens = list(range(20))
    full = hash_request_blocks(tokens, 4)
    assert hash_request_blocks(tokens, 4, start_hashes=full[:2]) == full
    # start hashes are trusted, not recomputed
    assert hash_request_blocks(tokens, 4, start_hashes=[123])[0] == 123
    hashes: list[int] = []
    for n in range(len(tokens) + 1):
        extend_block_hashes(hashes, tokens[:n], 4)
        assert hashes == full[: n // 4]


def test_sha256_option_is_stable_and_selectable():
    a = hash_request_blocks([1, 2, 3, 4, 5, 6, 7, 8], 4, hash_fn=sha256_hash)
    assert a == hash_request_blocks([1, 2, 3, 4, 5, 6, 7, 8], 4, hash_fn=get_hash_fn("sha256"))
    assert a != hash_request_blocks([1, 2, 3, 4, 5, 6, 7, 9], 4, hash_fn=sha256_hash)
    assert get_hash_fn("builtin") is hash
    with pytest.raises(ValueError, match="hash_fn"):
        get_hash_fn("md5")


def test_bad_arguments_name_the_field():
    with pytest.raises(ValueError, match="block_size"):
        hash_request_blocks([1, 2], 0)
    with pytest.raises(ValueError, match="start_hashes"):
        hash_request_blocks([1, 2, 3], 2, start_hashes=[1, 2])


@given(st.lists(st.integers(0, 3), max_size=40), st.lists(st.integers(0, 3), max_size=40), st.sampled_from([1, 2, 4]))
def test_equal_hash_chains_iff_equal_prefix_blocks(a, b, block_size):
    ha, hb = hash_request_blocks(a, block_size), hash_request_blocks(b, block_size)
    for i in range(min(len(ha), len(hb))):
        same = a[: (i + 1) * block_size] == b[: (i + 1) * block_size]
        assert (ha[i] == hb[i]) == same
