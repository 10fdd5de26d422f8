import pytest

from prefixgate.cache.block_pool import BlockPool
from prefixgate.cache.errors import InvalidArgumentError, OutOfPagesError
from prefixgate.cache.events import BlockRemoved, BlockStored
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
    pool = BlockPool(4, 2, event_sink=events.append)
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
    assert pool.num_evictions == 1
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
