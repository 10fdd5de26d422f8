import pytest

from prefixgate.cache.block_pool import BlockPool
from prefixgate.cache.errors import InvalidArgumentError, OutOfPagesError
from prefixgate.cache.events import BlockRemoved, BlockStored, FreeList, PageEvicted
from prefixgate.cache.hashing import BlockHasher


def free_ids(pool):
    return [p.page_id for p in pool.free_queue]


def test_allocate_release_order_exact():
    pool = BlockPool(6, 2)
    a = pool.allocate(3)
    assert [p.page_id for p in a] == [0, 1, 2]
    assert [p.ref_count for p in a] == [1, 1, 1]
    assert free_ids(pool) == [3, 4, 5]
    # hashless pages go to the FRONT (nobody can hit them), in release order
    pool.release(reversed(a))
    assert free_ids(pool) == [0, 1, 2, 3, 4, 5]


def test_cached_pages_go_to_the_back_and_stay_hittable_until_reused():
    events = []
    evicted = []
    pool = BlockPool(4, 2, event_sink=events.append, stats_sink=evicted.append)
    blocks = BlockHasher(2).hash_blocks([1, 2, 3, 4])
    p0, p1 = pool.allocate(2)
    assert pool.register(p0, blocks[0]) and pool.register(p1, blocks[1])
    assert events == [BlockStored(blocks[0].block_hash, blocks[0].parent_hash, 2),
                      BlockStored(blocks[1].block_hash, blocks[1].parent_hash, 2)]
    pool.release([p1, p0])  # tail first
    assert free_ids(pool) == [2, 3, 1, 0]
    assert pool.lookup(blocks[0]) is p0  # lazy eviction: still hittable
    pool.touch([p0])
    assert p0.ref_count == 1 and free_ids(pool) == [2, 3, 1]
    pool.release([p0])
    got = pool.allocate(3)  # 2, 3, then page 1 is evicted (the tail block, first)
    assert [p.page_id for p in got] == [2, 3, 1]
    assert evicted == [PageEvicted(1, FreeList.LRU)]
    assert pool.lookup(blocks[1]) is None and pool.lookup(blocks[0]) is p0
    assert events[-1] == BlockRemoved(blocks[1].block_hash)


def test_duplicate_hash_keeps_the_first_page():
    pool = BlockPool(4, 2)
    block = BlockHasher(2).hash_blocks([7, 7])[0]
    a, b = pool.allocate(2)
    assert pool.register(a, block)
    assert not pool.register(b, block)
    assert b.block_hash is None and pool.lookup(block) is a


def test_pin_survives_allocation_pressure():
    pool = BlockPool(3, 2)
    block = BlockHasher(2).hash_blocks([5, 6])[0]
    (p,) = pool.allocate(1)
    pool.register(p, block)
    assert pool.pin(p) and not pool.pin(p)
    pool.release([p])
    assert p.ref_count == 1 and pool.num_free_pages == 2
    with pytest.raises(OutOfPagesError):
        pool.allocate(3)
    pool.allocate(2)
    assert pool.lookup(block) is p
    assert pool.unpin(p) and p.ref_count == 0 and not pool.unpin(p)


def test_reset_drops_only_unreferenced_hashes():
    pool = BlockPool(4, 2)
    blocks = BlockHasher(2).hash_blocks([1, 2, 3, 4])
    a, b = pool.allocate(2)
    pool.register(a, blocks[0])
    pool.register(b, blocks[1])
    pool.release([b])
    assert pool.reset() == 1
    assert pool.lookup(blocks[1]) is None and pool.lookup(blocks[0]) is a
    assert free_ids(pool)[0] == b.page_id


def test_bad_input():
    with pytest.raises(InvalidArgumentError):
        BlockPool(0, 16)
    with pytest.raises(InvalidArgumentError):
        BlockPool(4, 0)
    pool = BlockPool(2, 2)
    with pytest.raises(InvalidArgumentError):
        pool.allocate(-1)
    (p,) = pool.allocate(1)
    pool.release([p])
    with pytest.raises(InvalidArgumentError, match="refcount 0"):
        pool.release([p])


# ------------------------------------------------------------------ holds (waiting requests)


def cached_pool(num_pages=6, tokens=(1, 2, 3, 4, 5, 6), clock=None, stats_sink=None):
    """A pool whose first len(tokens)/2 pages cache one prefix, released tail first."""
    pool = BlockPool(num_pages, 2, stats_sink=stats_sink, **({"clock": clock} if clock else {}))
    blocks = BlockHasher(2).hash_blocks(list(tokens))
    pages = pool.allocate(len(blocks))
    for page, block in zip(pages, blocks, strict=True):
        pool.register(page, block)
    pool.release(reversed(pages))
    return pool, blocks


def test_a_held_prefix_is_evicted_after_every_other_free_page():
    evicted = []
    pool, blocks = cached_pool(stats_sink=evicted.append)
    assert free_ids(pool) == [3, 4, 5, 2, 1, 0]
    pool.hold([b.block_hash for b in blocks[:2]])  # a waiting request hits blocks 0 and 1
    assert free_ids(pool) == [3, 4, 5, 2] and [p.page_id for p in pool.protected] == [1, 0]
    assert pool.num_free_pages == 6 and pool.num_protected_pages == 2
    got = pool.allocate(5)  # soft: the protected pages still go, last, tail before head
    assert [p.page_id for p in got] == [3, 4, 5, 2, 1]
    assert [e.source for e in evicted] == [FreeList.LRU, FreeList.PROTECTED]  # pages 2, 1
    assert pool.lookup(blocks[0]) is pool.pages[0]


def test_holds_are_counted_and_unhold_returns_the_page_to_the_lru_newest_end():
    pool, blocks = cached_pool()
    h = blocks[0].block_hash
    pool.hold([h])
    pool.hold([h])
    pool.unhold([h])
    assert [p.page_id for p in pool.protected] == [0]  # one request still holds it
    pool.unhold([h])
    assert pool.num_protected_pages == 0 and free_ids(pool) == [3, 4, 5, 2, 1, 0]
    assert pool.held_counts() == {}


def test_a_hash_held_before_it_is_cached_protects_the_page_that_caches_it():
    pool = BlockPool(4, 2)
    (block,) = BlockHasher(2).hash_blocks([7, 8])
    pool.hold([block.block_hash])  # another request is computing it right now
    (page,) = pool.allocate(1)
    pool.register(page, block)
    pool.release([page])
    assert page.protected and free_ids(pool) == [1, 2, 3]
    # a touched page leaves the protected queue and comes back when released
    pool.touch([page])
    assert not page.protected and pool.num_protected_pages == 0
    pool.release([page])
    assert [p.page_id for p in pool.protected] == [0]


def test_retained_pages_go_before_protected_ones_and_a_retention_survives_the_hold():
    now = [0.0]
    pool, blocks = cached_pool(clock=lambda: now[0])
    p0, p2 = pool.pages[0], pool.pages[2]
    assert pool.retain(p0, 10.0) and pool.retain(p2, 5.0)
    pool.hold([blocks[0].block_hash])  # p0: retained and held: protected, deadline kept
    assert [p.page_id for p in pool.protected] == [0] and p0.retain_until == 10.0
    assert [p.page_id for p in pool.allocate(5)] == [3, 4, 5, 1, 2]  # LRU, retained, then held
    pool.unhold([blocks[0].block_hash])
    assert p0 in pool.retained  # back under its unexpired retention


def test_reset_drops_protected_hashes_too():
    pool, blocks = cached_pool()
    pool.hold([blocks[1].block_hash])
    assert pool.reset() == 3
    assert pool.num_protected_pages == 0 and not pool.pages[1].protected
    assert free_ids(pool) == [1, 0, 2, 3, 4, 5]  # hashless now: at the front
    pool.unhold([blocks[1].block_hash])  # no page carries it any more: a no-op
    assert pool.held_counts() == {}
