import math

import pytest

from prefixgate.cache import (
    DuplicateSequenceError,
    InvalidArgumentError,
    KVCacheManager,
    OutOfPagesError,
    UnknownSequenceError,
    make_extra_keys,
)
from prefixgate.cache.events import BlockRemoved, BlockStored
from prefixgate.cache.sequence import TokenSequence


def run_prompt(m, seq_id, tokens, **kw):
    """Allocate and compute a whole prompt, as the scheduler does in one chunk."""
    alloc = m.allocate(TokenSequence(seq_id, list(tokens), **kw))
    n = len(tokens) - alloc.num_cached_tokens
    pairs = m.prepare_write(seq_id, n)
    m.commit_computed(seq_id, n)
    m.check_integrity()
    return alloc, pairs


def append(m, seq_id, tokens):
    """Sampled tokens into the sequence's record (the engine's part)."""
    m.sequence(seq_id).token_ids.extend(tokens)


def fork(m, parent_id, child_id):
    parent = m.sequence(parent_id)
    m.fork(parent_id, TokenSequence(child_id, list(parent.token_ids), parent.extra_keys))


def test_exact_pages_refcounts_and_free_order():
    m = KVCacheManager(8, 4, watermark=0)
    alloc, pairs = run_prompt(m, "a", list(range(10)))
    assert alloc.num_cached_tokens == 0 and pairs == []
    assert m.block_table("a") == [0, 1, 2]
    alloc, _ = run_prompt(m, "b", list(range(8)) + [50, 51, 52])
    assert alloc == (8, (0, 1))
    assert m.block_table("b") == [0, 1, 3]
    assert [m.ref_count(i) for i in range(4)] == [2, 2, 1, 1]
    m.free("a")
    # a's hashless tail (page 2) goes to the front; its cached pages stay referenced by b
    assert [p.page_id for p in m.pool.free_queue] == [2, 4, 5, 6, 7]
    m.free("b")
    # b frees tail first: page 3 (hashless) to the front, then cached 1, 0 at the back
    assert [p.page_id for p in m.pool.free_queue] == [3, 2, 4, 5, 6, 7, 1, 0]
    assert m.stats().pages_cached_free == 2
    m.check_integrity()


def test_full_hit_stops_one_token_short_and_copies_the_last_page():
    m = KVCacheManager(8, 4, watermark=0)
    tokens = list(range(8))
    run_prompt(m, "a", tokens)
    alloc = m.allocate(TokenSequence("b", tokens))
    assert alloc.num_cached_tokens == 7  # the last token is always computed
    assert alloc.block_table == (0, 1)
    pairs = m.prepare_write("b", 1)
    assert pairs == [(1, 2)]  # page 1 is shared and cached: never written in place
    assert m.block_table("b") == [0, 2]
    assert m.ref_count(1) == 1 and m.ref_count(2) == 1
    m.commit_computed("b", 1)
    m.check_integrity()
    assert m.stats().cow_copies == 1


def test_prompt_of_one_token_and_exact_block():
    m = KVCacheManager(4, 4, watermark=0)
    run_prompt(m, "a", [9])
    alloc, _ = run_prompt(m, "b", [9])
    assert alloc.num_cached_tokens == 0  # partial blocks are never cached


def test_decode_growth_takes_a_page_only_when_the_block_starts():
    m = KVCacheManager(8, 4, watermark=0)
    run_prompt(m, "a", list(range(4)))
    assert len(m.block_table("a")) == 1
    for step, token in enumerate(range(100, 105)):
        append(m, "a", [token])
        before = len(m.block_table("a"))
        assert m.pages_needed("a", 1) == (1 if step % 4 == 0 else 0)
        m.prepare_write("a", 1)
        m.commit_computed("a", 1)
        assert len(m.block_table("a")) - before == (1 if step % 4 == 0 else 0)
    assert m.block_table("a") == [0, 1, 2]
    m.check_integrity()


def test_fork_shares_tail_and_copies_on_first_write():
    m = KVCacheManager(8, 4, watermark=0)
    run_prompt(m, "p", list(range(6)))  # pages 0 (full, cached), 1 (2 tokens)
    fork(m, "p", "c")
    assert m.block_table("c") == [0, 1]
    assert m.ref_count(0) == 2 and m.ref_count(1) == 2
    append(m, "c", [77])
    assert m.prepare_write("c", 1) == [(1, 2)]
    assert m.block_table("c") == [0, 2] and m.ref_count(1) == 1
    m.commit_computed("c", 1)
    append(m, "p", [88])
    assert m.prepare_write("p", 1) == []  # the parent is now the only holder of page 1
    m.commit_computed("p", 1)
    m.check_integrity()
    m.free("p")
    m.free("c")
    assert m.stats().pages_used == 0
    m.check_integrity()


def test_forced_collision_never_serves_wrong_kv():
    # Every block hashes to the same digest: only verification can tell them apart.
    m = KVCacheManager(8, 4, watermark=0, hash_fn=lambda data: b"\x00" * 16)
    run_prompt(m, "a", [1, 2, 3, 4, 5])
    alloc, _ = run_prompt(m, "b", [9, 9, 9, 9, 5])
    assert alloc.num_cached_tokens == 0
    assert m.block_table("b")[0] != m.block_table("a")[0]
    alloc, _ = run_prompt(m, "c", [1, 2, 3, 4, 6])  # the genuine content still hits
    assert alloc.num_cached_tokens == 4 and m.block_table("c")[0] == m.block_table("a")[0]


def test_tenants_and_cache_salt_isolate():
    m = KVCacheManager(16, 4, watermark=0)
    tokens = list(range(12))
    run_prompt(m, "a", tokens, extra_keys=make_extra_keys("m", "t1"), tenant="t1")
    assert run_prompt(m, "b", tokens, extra_keys=make_extra_keys("m", "t2"), tenant="t2")[0].num_cached_tokens == 0
    assert run_prompt(m, "c", tokens, extra_keys=make_extra_keys("m", "t1", "s"), tenant="t1")[0].num_cached_tokens == 0
    assert run_prompt(m, "d", tokens, extra_keys=make_extra_keys("m", "t1"), tenant="t1")[0].num_cached_tokens == 11
    stats = m.stats()
    assert stats.per_tenant["t1"].hit_tokens == 11 and stats.per_tenant["t2"].hit_tokens == 0
    assert stats.total.query_tokens == 48


def test_watermark_admission():
    m = KVCacheManager(10, 4, watermark=0.2)
    assert m.watermark_pages == 2
    assert m.can_allocate(8) and not m.can_allocate(9)
    match = m.find_prefix(list(range(30)))
    assert m.pages_needed_for_prompt(30, match) == 8


def test_pending_blocks_are_reported_for_in_flight_dedup():
    m = KVCacheManager(16, 4, watermark=0)
    prompt = list(range(12))
    m.allocate(TokenSequence("a", prompt + [100]))
    match = m.find_prefix(prompt + [200])
    assert match.num_cached_tokens == 0 and match.num_pending_tokens == 12
    m.prepare_write("a", 4)
    m.commit_computed("a", 4)
    match = m.find_prefix(prompt + [200])
    assert match.num_cached_tokens == 4 and match.num_pending_tokens == 8
    m.free("a")  # aborting the computing sequence releases its claims
    assert m.find_prefix(prompt + [200]).num_pending_tokens == 0


def test_a_block_far_ahead_of_its_owners_frontier_is_not_in_flight():
    m = KVCacheManager(32, 4, watermark=0)
    m.allocate(TokenSequence("slow", list(range(24)) + [7]))  # cold, computed in chunks
    m.prepare_write("slow", 4)
    m.commit_computed("slow", 4)
    # another sequence caches blocks 0-2 of the same prefix (it computes them itself)
    m.allocate(TokenSequence("other", list(range(12)) + [99]))
    m.prepare_write("other", 9)
    m.commit_computed("other", 9)
    m.free("other")
    # a request whose next block (12-16) only the slow owner will compute, two chunks from now:
    # not in flight yet, so it computes that block itself instead of waiting for both chunks
    match = m.find_prefix(list(range(16)) + [5])
    assert match.num_cached_tokens == 12 and match.num_pending_tokens == 0
    m.prepare_write("slow", 8)
    m.commit_computed("slow", 8)  # its frontier is at 12: the block is its next one
    assert m.find_prefix(list(range(16)) + [5]).num_pending_tokens == 4


def test_events_mirror_the_hittable_set():
    events = []
    m = KVCacheManager(3, 2, watermark=0, event_sink=events.append)
    run_prompt(m, "a", [1, 2, 3, 4, 5])
    stored = [e for e in events if isinstance(e, BlockStored)]
    assert len(stored) == 2 and stored[1].parent_hash == stored[0].block_hash
    m.free("a")
    run_prompt(m, "b", [7, 7, 7, 7, 7, 7])  # needs all 3 pages: two cached ones are evicted
    removed = {e.block_hash for e in events if isinstance(e, BlockRemoved)}
    assert removed == {e.block_hash for e in stored}
    live = set()
    for e in events:
        if isinstance(e, BlockStored):
            live.add(e.block_hash)
        else:
            live.discard(e.block_hash)
    assert live == set(m.pool.cached)


def test_pin_keeps_a_prefix_resident_and_counts_as_a_reference():
    m = KVCacheManager(4, 2, watermark=0)
    tokens = [1, 2, 3, 4]
    run_prompt(m, "a", tokens)
    m.free("a")
    assert m.pin(tokens) == 2
    assert m.stats().pages_pinned == 2 and m.stats().pages_used == 2
    run_prompt(m, "b", [9, 9, 9, 9])  # only 2 pages are free: the pinned ones are not taken
    m.free("b")
    assert run_prompt(m, "c", tokens)[0].num_cached_tokens == 3
    m.free("c")
    assert m.unpin(tokens) == 2 and m.stats().pages_pinned == 0
    m.check_integrity()


def test_fragmentation_and_top_prefixes():
    m = KVCacheManager(16, 4, watermark=0)
    system = list(range(8))
    for i in range(3):
        run_prompt(m, i, system + [100 + i])
    s = m.stats()
    # pages: 2 shared full + 3 tails holding 1 token each -> 15 unused slots of 20
    assert s.fragmentation == pytest.approx(9 / 20)
    assert s.top_prefixes[0].num_sharers == 3 and s.top_prefixes[0].num_tokens == 8
    assert s.top_prefixes[0].token_ids == tuple(system)


@pytest.mark.parametrize("block_size", [1, 2, 3, 16])
def test_seed_parity_pages_for_n_tokens(block_size):
    m = KVCacheManager(64, block_size, watermark=0, enable_caching=False)
    for n in (1, block_size, block_size + 1, 3 * block_size - 1, 37):
        run_prompt(m, n, [7] * n)
        assert len(m.block_table(n)) == math.ceil(n / block_size)
        # an append crossing a block boundary takes exactly one new page (block size 1 too)
        pages = m.num_free_pages
        append(m, n, [1])
        crossing = n % block_size == 0
        m.prepare_write(n, 1)
        assert pages - m.num_free_pages == (1 if crossing else 0)
        m.commit_computed(n, 1)
        m.free(n)
        assert m.num_free_pages == 64


def test_caching_off_never_hits():
    m = KVCacheManager(8, 2, watermark=0, enable_caching=False)
    run_prompt(m, "a", [1, 2, 3, 4])
    assert run_prompt(m, "b", [1, 2, 3, 4])[0].num_cached_tokens == 0
    assert not m.pool.cached


def test_bad_input_is_named():
    m = KVCacheManager(2, 2, watermark=0)
    with pytest.raises(InvalidArgumentError):
        KVCacheManager(0, 2)
    with pytest.raises(InvalidArgumentError):
        KVCacheManager(2, -1)
    with pytest.raises(InvalidArgumentError):
        KVCacheManager(2, 2, watermark=1.5)
    with pytest.raises(InvalidArgumentError, match="empty"):
        m.allocate(TokenSequence("a", []))
    with pytest.raises(UnknownSequenceError, match="free: unknown sequence id 'x'"):
        m.free("x")
    with pytest.raises(UnknownSequenceError, match="fork"):
        m.fork("x", TokenSequence("y", [1]))
    m.allocate(TokenSequence("a", [1, 2, 3]))
    with pytest.raises(DuplicateSequenceError):
        m.allocate(TokenSequence("a", [1]))
    with pytest.raises(DuplicateSequenceError):
        m.fork("a", TokenSequence("a", [1, 2, 3]))
    with pytest.raises(InvalidArgumentError, match="exceed"):
        m.prepare_write("a", 4)
    with pytest.raises(InvalidArgumentError, match="not prepared"):
        m.commit_computed("a", 1)
    append(m, "a", [4, 5, 6])
    with pytest.raises(OutOfPagesError):
        m.prepare_write("a", 6)
    m.check_integrity()  # nothing changed by the failed write
    m.free("a")
    with pytest.raises(UnknownSequenceError):
        m.free("a")  # double free
    m.check_integrity()


def test_precomputed_blocks_are_used_and_checked():
    m = KVCacheManager(8, 4, watermark=0)
    tokens = list(range(10))
    blocks = m.hasher.hash_blocks(tokens)
    run_prompt(m, "a", tokens)
    assert m.find_prefix(tokens, blocks=blocks) == m.find_prefix(tokens)
    with pytest.raises(InvalidArgumentError, match="block hashes"):
        m.allocate(TokenSequence("b", tokens[:4], block_hashes=list(blocks)))
    b = TokenSequence("b", tokens, block_hashes=blocks[:1])  # a chain is extended, not redone
    assert m.allocate(b).num_cached_tokens == 8 and b.block_hashes[0] is blocks[0]
    assert b.block_hashes == blocks
    m.check_integrity()


def test_agents_and_prefixes_are_keyed_by_tenant():
    """One agent label in two tenants: summed for the admin, apart per tenant; shared prefixes
    carry their tenant and the snapshot keeps each tenant's own top_k."""
    m = KVCacheManager(32, 4, watermark=0)
    alpha_system, beta_system = list(range(8)), list(range(50, 62))
    for i in range(2):
        run_prompt(m, ("a", i), alpha_system + [100 + i], tenant="alpha", agent="planner",
                   extra_keys=make_extra_keys("m", "alpha"))
    for i in range(3):
        run_prompt(m, ("b", i), beta_system + [200 + i], tenant="beta", agent="planner",
                   extra_keys=make_extra_keys("m", "beta"))
    s = m.stats(top_k=1)
    assert s.per_agent["planner"].requests == 5
    assert s.per_tenant_agent["alpha"]["planner"].requests == 2
    assert s.per_tenant_agent["beta"]["planner"].requests == 3
    # beta's prefix is busier, yet alpha keeps its own (top_k counts per tenant)
    assert [(p.tenant, p.num_sharers) for p in s.top_prefixes] == [("beta", 3), ("alpha", 2)]

    alpha = s.for_tenant("alpha")
    assert alpha.total == s.per_tenant["alpha"] and set(alpha.per_tenant) == {"alpha"}
    assert alpha.per_agent == {"planner": s.per_tenant_agent["alpha"]["planner"]}
    assert [p.token_ids for p in alpha.top_prefixes] == [tuple(alpha_system)]
    nobody = s.for_tenant("gamma")
    assert nobody.total.requests == 0 and not nobody.per_tenant and not nobody.per_agent
    assert nobody.top_prefixes == () and nobody.num_pages == s.num_pages


def test_a_waiting_requests_hold_keeps_its_hit_and_integrity_checks_it():
    m = KVCacheManager(6, 4, watermark=0)
    run_prompt(m, "a", list(range(12)))
    m.free("a")  # pages 2, 1, 0 free-but-cached, tail first
    blocks = m.hasher.hash_blocks(list(range(12)) + [99])
    m.hold_prefix("waiting", blocks)
    assert m.count_cached_blocks(blocks) == 3 and m.count_cached_blocks(blocks, hint=2) == 3
    assert m.stats().pages_protected == 3
    run_prompt(m, "b", list(range(100, 112)))  # takes the 3 unprotected pages
    assert m.block_table("b") == [3, 4, 5]
    assert m.find_prefix(list(range(12)) + [99]).num_cached_tokens == 12  # the hit survived
    m.release_hold("waiting")
    m.release_hold("waiting")  # twice is a no-op
    assert m.stats().pages_protected == 0 and m.pool.held_counts() == {}
    m.check_integrity()


def test_check_integrity_catches_a_protected_page_nobody_holds():
    from prefixgate.cache import IntegrityError

    m = KVCacheManager(4, 4, watermark=0)
    run_prompt(m, "a", list(range(4)))
    m.free("a")
    m.hold_prefix("w", m.hasher.hash_blocks(list(range(4))))
    m.kept.holds.clear()  # noqa: SLF001 (break the bookkeeping on purpose)
    with pytest.raises(IntegrityError, match="hold counts"):
        m.check_integrity()


def test_release_all_holds_and_sequence_ids_for_recovery():
    m = KVCacheManager(8, 4, watermark=0)
    run_prompt(m, "a", list(range(8)))
    m.hold_prefix("w1", m.hasher.hash_blocks(list(range(8))))
    m.hold_prefix("w2", m.hasher.hash_blocks(list(range(4))))
    assert m.sequence_ids() == ["a"]
    m.free("a")
    assert m.stats().pages_protected == 2
    m.release_all_holds()
    assert m.stats().pages_protected == 0 and m.pool.held_counts() == {}
    m.check_integrity()
