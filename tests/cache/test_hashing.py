import pytest

from prefixgate.cache.hashing import BlockHasher, make_extra_keys, tokens_to_bytes


def test_only_full_blocks_are_hashed():
    h = BlockHasher(4)
    assert len(h.hash_blocks(list(range(3)))) == 0
    assert len(h.hash_blocks(list(range(4)))) == 1
    assert len(h.hash_blocks(list(range(11)))) == 2


def test_chain_parent_and_prefix_stability():
    h = BlockHasher(4)
    a = h.hash_blocks([1, 2, 3, 4, 5, 6, 7, 8])
    b = h.hash_blocks([1, 2, 3, 4, 5, 6, 7, 9])
    assert a[0] == b[0]
    assert a[1].block_hash != b[1].block_hash
    assert a[1].parent_hash == a[0].block_hash
    assert a[0].parent_hash == h.root
    # same block content after a different parent hashes differently (it is a chain)
    c = h.hash_blocks([9, 9, 9, 9, 5, 6, 7, 8])
    assert c[1].token_bytes == a[1].token_bytes and c[1].block_hash != a[1].block_hash


def test_incremental_equals_full():
    h = BlockHasher(3)
    tokens = list(range(20))
    full = h.hash_blocks(tokens)
    head = h.hash_blocks(tokens[:7])
    tail = h.hash_blocks(tokens, start_block=2, parent=head[-1].block_hash)
    assert head + tail == full


def test_extra_keys_salt_the_whole_chain():
    h = BlockHasher(2)
    tokens = [1, 2, 3, 4, 5, 6]
    plain = h.hash_blocks(tokens, make_extra_keys("m", "tenant-a"))
    other = h.hash_blocks(tokens, make_extra_keys("m", "tenant-b"))
    salted = h.hash_blocks(tokens, make_extra_keys("m", "tenant-a", cache_salt="s"))
    for x, y, z in zip(plain, other, salted, strict=True):
        assert len({x.block_hash, y.block_hash, z.block_hash}) == 3
    assert plain[0].extra_keys and not plain[1].extra_keys
    # length prefixes keep field boundaries unambiguous
    assert make_extra_keys("ab", "c") != make_extra_keys("a", "bc")


def test_seed_changes_every_hash_and_is_deterministic():
    tokens = list(range(8))
    assert BlockHasher(4, seed=1).hash_blocks(tokens) == BlockHasher(4, seed=1).hash_blocks(tokens)
    assert BlockHasher(4, seed=1).hash_blocks(tokens)[0] != BlockHasher(4, seed=2).hash_blocks(tokens)[0]


def test_bad_input():
    with pytest.raises(ValueError):
        BlockHasher(0)
    with pytest.raises(ValueError):
        BlockHasher(4, seed=-1)
    with pytest.raises(ValueError):
        tokens_to_bytes([2**32])
    with pytest.raises(ValueError):
        BlockHasher(4).hash_blocks(list(range(8)), start_block=1)
