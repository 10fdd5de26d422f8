"""The second tier's pure parts: the entry format and its checksum, the bounded host store,
and the manager's side (evictions captured in order, loaded blocks installed as verified
cached pages with exact page ids)."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from prefixgate.cache import KVCacheManager, TokenSequence, make_extra_keys
from prefixgate.cache.hashing import HashedBlock
from prefixgate.cache.tier import HostTier, TierEntry, decode_entry, entry_slot_bytes, verify_entry

BLOCK = HashedBlock(b"h" * 16, b"p" * 16, bytes(range(16)), make_extra_keys("m", "tenant-a"))
ENTRY = TierEntry(BLOCK, b"float32|L2", bytes(range(256)) * 4)


def test_entry_round_trip_and_verification():
    blob = ENTRY.encode()
    assert decode_entry(blob) == ENTRY
    assert verify_entry(decode_entry(blob), BLOCK, b"float32|L2", 1024)
    # another tenant's salt, other tokens, another parent, another layout or size: refused
    for block, layout, size in (
        (BLOCK._replace(extra_keys=make_extra_keys("m", "tenant-b")), b"float32|L2", 1024),
        (BLOCK._replace(token_bytes=bytes(16)), b"float32|L2", 1024),
        (BLOCK._replace(parent_hash=b"q" * 16), b"float32|L2", 1024),
        (BLOCK, b"bfloat16|L2", 1024),
        (BLOCK, b"float32|L2", 2048),
    ):
        assert not verify_entry(decode_entry(blob), block, layout, size)
    assert decode_entry(blob[:-1]) is None and decode_entry(blob + b"x") is None


@settings(max_examples=200, deadline=None)
@given(st.data())
def test_any_flipped_bit_fails_the_entry(data):
    blob = bytearray(ENTRY.encode())
    at = data.draw(st.integers(0, len(blob) - 1))
    blob[at] ^= 1 << data.draw(st.integers(0, 7))
    decoded = decode_entry(bytes(blob))
    # a flip in the header's padding bytes is harmless; anywhere else it is caught
    assert decoded is None or decoded == ENTRY


def test_host_tier_is_bounded_and_evicts_least_recently_used(tmp_path):
    for path in (None, tmp_path / "tier.bin"):
        store = HostTier(3 * 100, 100, path=path)
        for key in (b"a", b"b", b"c"):
            assert store.put(key, key * 50)
        assert store.get_many([b"a"]) == [b"a" * 50]  # a is now the most recent
        assert store.put(b"d", b"d" * 60)  # full: b (least recently used) goes
        assert store.get_many([b"a", b"b", b"c", b"d"]) == [b"a" * 50, None, b"c" * 50, b"d" * 60]
        assert store.usage() == (3, 160, 300) and store.num_evicted == 1
        assert not store.put(b"e", b"e" * 101)  # larger than a slot: refused
        store.discard(b"c")
        assert store.may_contain(b"c") is False and store.usage()[0] == 2
        store.close()
    with pytest.raises(ValueError):
        HostTier(10, entry_slot_bytes(100))


def test_evictions_are_captured_in_order_and_installs_are_exact():
    m = KVCacheManager(6, 4, watermark=0)
    m.capture_evictions()
    tokens = list(range(12))
    m.allocate(TokenSequence("a", tokens))
    m.prepare_write("a", 12)
    m.commit_computed("a", 12)
    m.free("a")  # pages 2, 1, 0 join the LRU tail first (tail first)
    blocks = m.hasher.hash_blocks(tokens)
    m.allocate(TokenSequence("b", list(range(100, 124))))
    m.prepare_write("b", 24)  # takes 3 fresh pages, then evicts 2, 1, 0 in LRU order
    assert [b for _, b in m.take_evicted()] == [blocks[2], blocks[1], blocks[0]]
    m.free("b")
    # the tier brings a's blocks back: fresh pages, registered, free-but-cached
    m2 = KVCacheManager(6, 4, watermark=0)
    m2.capture_evictions()
    page_ids = m2.install_blocks(blocks, max_pages=3)
    assert page_ids == [0, 1, 2]
    # released tail first like free(): the head outlives the tail in the LRU
    assert [p.page_id for p in m2.pool.free_queue] == [3, 4, 5, 2, 1, 0]
    match = m2.find_prefix(tokens + [7])
    assert match.num_cached_tokens == 12 and match.page_ids == (0, 1, 2)
    m2.check_integrity()
    # a block cached meanwhile ends the install (one copy per hash)
    assert m2.install_blocks(blocks, max_pages=3) == []


def test_an_installed_page_evicted_before_its_load_is_written_is_not_spilled():
    m = KVCacheManager(3, 4, watermark=0)
    m.capture_evictions()
    blocks = m.hasher.hash_blocks(list(range(12)))
    assert m.install_blocks(blocks, max_pages=3) == [0, 1, 2]
    m.allocate(TokenSequence("x", list(range(50, 62))))
    m.prepare_write("x", 12)  # reuses all three before the loads were written
    assert m.take_evicted() == []  # the pool never held their K/V: nothing true to spill
    m.check_integrity()
