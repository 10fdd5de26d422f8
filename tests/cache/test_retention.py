"""Retention in the page pool (cache/block_pool.py, cache/retention.py): soft, deadline-ordered.

Retained free pages are evicted only after every unretained free page, earliest deadline
first; they never block an allocation; an expired retention returns the page to the LRU; a hit
renews the deadline; a budget bounds how much is retained, in the pool and per tenant; a hit on
retained free pages counts as a retention hit."""

from __future__ import annotations

from prefixgate.cache import KVCacheManager
from tests.cache.test_manager import run_prompt

PAGE = 4


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def manager_with_clock(num_pages: int = 8) -> tuple[KVCacheManager, Clock]:
    clock = Clock()
    manager = KVCacheManager(num_pages, PAGE, watermark=0)
    manager.pool.clock = clock
    return manager, clock


def cached(manager: KVCacheManager, tokens: list[int]) -> int:
    """How many leading full blocks of ``tokens`` are hittable."""
    return len(manager.lookup.cached_prefix_pages(tokens, b""))


def finished(manager: KVCacheManager, name: str, tokens: list[int]) -> None:
    run_prompt(manager, name, tokens)
    manager.free(name)


def test_retained_pages_are_evicted_after_unretained_ones_earliest_deadline_first():
    m, clock = manager_with_clock(8)
    a, b, c = list(range(8)), list(range(100, 108)), list(range(200, 208))  # 2 pages each
    for name, tokens in (("a", a), ("b", b), ("c", c)):
        finished(m, name, tokens)
    assert m.retain(a, b"", ttl_s=30) == 2
    assert m.retain(b, b"", ttl_s=10) == 2
    m.check_integrity()
    stats = m.stats()
    assert stats.pages_retained == 4 and stats.pages_cached_free == 6
    # a new 6-page prompt: 2 hashless + c's 2 (unretained, LRU) + b's 2 (earliest deadline)
    run_prompt(m, "big", list(range(300, 324)))
    assert cached(m, c) == 0 and cached(m, b) == 0 and cached(m, a) == 2
    assert m.stats().retained_evicted == 2
    m.check_integrity()


def test_retention_never_blocks_an_allocation():
    m, _ = manager_with_clock(4)
    finished(m, "a", list(range(16)))  # every page cached...
    assert m.retain(list(range(16)), b"", ttl_s=60) == 4  # ...and retained
    assert m.num_free_pages == 4  # still free
    run_prompt(m, "b", list(range(50, 66)))  # takes all four
    assert m.stats().retained_evicted == 4
    m.check_integrity()


def test_expiry_returns_pages_to_the_lru_and_a_hit_renews_the_deadline():
    m, clock = manager_with_clock(8)
    a, b = list(range(8)), list(range(100, 108))
    finished(m, "a", a)
    finished(m, "b", b)
    m.retain(a, b"", ttl_s=10)
    clock.now += 8
    run_prompt(m, "again", a + [1, 2])  # a hit at t+8 renews a's retention to t+18
    m.free("again")
    clock.now += 5  # t+13: past the first deadline, inside the renewed one
    run_prompt(m, "x", list(range(300, 324)))  # 6 pages: the hashless four, then LRU b
    assert cached(m, a) == 2 and cached(m, b) == 0
    m.free("x")
    clock.now += 10  # t+23: a's retention expired; it is an ordinary LRU page again
    run_prompt(m, "y", list(range(400, 432)))  # 8 pages: everything is reused
    assert cached(m, a) == 0
    assert m.stats().retention_expiries == 2 and m.stats().retained_evicted == 0
    m.check_integrity()


def test_the_budget_bounds_the_retained_pages_and_reset_drops_retention():
    m, _ = manager_with_clock(8)
    a, b = list(range(8)), list(range(100, 108))
    finished(m, "a", a)
    finished(m, "b", b)
    assert m.retain(a, b"", ttl_s=30, max_pages=3) == 2
    assert m.retain(b, b"", ttl_s=30, max_pages=3) == 1  # one page left in the budget
    assert m.stats().pages_retained == 3
    assert m.retain(a, b"", ttl_s=60, max_pages=3) == 2  # renewing costs no budget
    assert m.reset_cache() == 4
    assert m.stats().pages_retained == 0 and m.num_free_pages == 8
    m.check_integrity()


def finished_pages(manager: KVCacheManager, name: str, tokens: list[int], **kw) -> list[int]:
    """Compute and free a prompt; returns the pages it held."""
    run_prompt(manager, name, tokens, **kw)
    table = manager.block_table(name)
    manager.free(name)
    return table


def test_a_tenant_budget_bounds_each_tenants_retained_pages_and_spares_pins():
    # without a global budget the tenant's share is a plain cap
    m, _ = manager_with_clock(10)
    alpha, beta = b"salt-alpha", b"salt-beta"
    a1, a2, b1 = list(range(8)), list(range(100, 108)), list(range(200, 208))  # 2 pages each
    a1_pages = finished_pages(m, "a1", a1, extra_keys=alpha, tenant="alpha")
    a2_pages = finished_pages(m, "a2", a2, extra_keys=alpha, tenant="alpha")
    b1_pages = finished_pages(m, "b1", b1, extra_keys=beta, tenant="beta")
    assert m.retain(a1, alpha, 30, tenant="alpha", max_tenant_pages=3) == 2
    # alpha's third and last page: a2's tail (retention walks tail first: the session's own
    # history before a head it may share)
    assert m.retain(a2, alpha, 30, tenant="alpha", max_tenant_pages=3) == 1
    assert m.retain(b1, beta, 30, tenant="beta", max_tenant_pages=3) == 2  # alpha costs beta nothing
    retained_by = {t: [p.page_id for p in m.pool.pages if p.retain_tenant == t] for t in ("alpha", "beta")}
    assert retained_by == {"alpha": sorted([*a1_pages, a2_pages[1]]), "beta": sorted(b1_pages)}
    assert m.num_retained_pages("alpha") == 3 and m.num_retained_pages("beta") == 2
    assert m.retain(a1, alpha, 60, tenant="alpha", max_tenant_pages=3) == 2  # renewing is free
    stats = m.stats()
    assert stats.retained_per_tenant == {"alpha": 3, "beta": 2} and stats.pages_retained == 5
    assert stats.for_tenant("beta").retained_per_tenant == {"beta": 2}
    # explicit pins are not retention: a pin past the budget still holds every page
    assert m.pin(a2, alpha) == 2 and m.stats().pages_pinned == 2
    assert m.num_retained_pages("alpha") == 3
    m.check_integrity()


def test_a_tenant_alone_borrows_the_idle_budget_and_gives_it_back_to_a_tenant_below_its_share():
    m, clock = manager_with_clock(12)
    alpha, beta = b"salt-alpha", b"salt-beta"
    budgets = dict(max_pages=6, max_tenant_pages=2)
    sessions = [list(range(100 * i, 100 * i + 8)) for i in range(3)]  # alpha: 3 x 2 pages
    tables = []
    for i, tokens in enumerate(sessions):
        tables.append(finished_pages(m, f"a{i}", tokens, extra_keys=alpha, tenant="alpha"))
        clock.now += 1  # session i's retention ends after session i-1's
        assert m.retain(tokens, alpha, 30, tenant="alpha", **budgets) == 2
    # alone, alpha holds the whole global budget, three times its share of 2
    assert m.num_retained_pages("alpha") == 6 and m.num_retained_pages() == 6
    assert m.stats().retention_reclaimed == 0
    b = list(range(900, 912))  # 3 pages
    b_pages = finished_pages(m, "b", b, extra_keys=beta, tenant="beta")
    # the budget is full: beta takes back its share of 2 from alpha (past its own), alpha's
    # earliest deadlines first (session 0), and its head page goes to the LRU
    assert m.retain(b, beta, 30, tenant="beta", **budgets) == 2
    assert m.num_retained_pages("beta") == 2 and m.num_retained_pages("alpha") == 4
    assert [p.page_id for p in m.pool.pages if p.retain_tenant == "beta"] == sorted(b_pages[1:])
    assert all(m.pool.pages[i].retain_until == 0 for i in tables[0])
    assert all(m.pool.pages[i].retain_until > 0 for i in (*tables[1], *tables[2]))
    # the reclaimed pages are ordinary LRU pages again, still cached
    assert all(m.pool.pages[i] in m.pool.free_queue for i in tables[0])
    assert len(m.lookup.cached_prefix_pages(sessions[0], alpha)) == 2
    assert m.stats().retention_reclaimed == 2
    # at its share, with the budget full, beta retains no more; alpha (past its share) none
    b2 = list(range(1000, 1004))
    finished_pages(m, "b2", b2, extra_keys=beta, tenant="beta")
    assert m.retain(b2, beta, 30, tenant="beta", **budgets) == 0
    assert m.retain(sessions[0], alpha, 30, tenant="alpha", **budgets) == 0
    assert m.num_retained_pages() == 6
    m.check_integrity()


def test_a_retention_hit_is_a_hit_on_retained_free_pages_only():
    m, clock = manager_with_clock(8)
    a, b, c = list(range(8)), list(range(100, 108)), list(range(200, 204))
    finished(m, "a", a)  # oldest in the LRU: the first cached page plain LRU would evict
    finished(m, "b", b)
    assert m.retain(a, b"", ttl_s=30) == 2
    run_prompt(m, "big", list(range(300, 324)))  # 6 pages: 4 hashless + b's 2, never a's
    m.free("big")
    assert cached(m, a) == 2 and cached(m, b) == 0
    alloc, _ = run_prompt(m, "back", a + [9, 9], tenant="t", agent="coder")
    assert alloc.num_cached_tokens == 8
    stats = m.stats()
    assert (stats.total.retention_hits, stats.total.retention_hit_tokens) == (1, 8)
    assert stats.per_tenant["t"].retention_hit_tokens == 8
    assert stats.per_tenant_agent["t"]["coder"].retention_hit_tokens == 8
    assert stats.per_agent["coder"].retention_hits == 1
    # a hit on the same pages while they are referenced (not free): no retention hit
    run_prompt(m, "sibling", a + [7], tenant="t", agent="coder")
    assert m.stats().per_tenant["t"].retention_hit_tokens == 8
    m.free("back")
    m.free("sibling")
    # a whole-prompt hit stops one token short (invariant 5): 4 + 3 tokens
    run_prompt(m, "exact", a, tenant="t")
    m.free("exact")
    assert m.stats().per_tenant["t"].retention_hit_tokens == 8 + 7
    # a hit on a free cached page that is not retained: an ordinary hit
    finished(m, "c", c + [1])
    run_prompt(m, "c-again", c + [2], tenant="t")
    m.free("c-again")
    stats = m.stats()
    assert stats.per_tenant["t"].hit_tokens == 8 + 8 + 7 + 4
    assert stats.per_tenant["t"].retention_hit_tokens == 15 and stats.total.retention_hits == 2
    # an expired retention (not yet swept) no longer counts
    clock.now += 1000
    run_prompt(m, "late", a + [5], tenant="t")
    assert m.stats().per_tenant["t"].retention_hit_tokens == 15
    m.check_integrity()


def test_retention_spends_the_budget_on_the_sessions_own_tail_not_a_shared_head():
    m, _ = manager_with_clock(12)
    head = list(range(8))  # a system prompt two agents share (2 pages)
    mine, other = head + list(range(100, 108)), head + list(range(200, 208))
    run_prompt(m, "other", other)  # another agent is mid-turn on the shared head
    mine_pages = finished_pages(m, "mine", mine)
    assert m.retain(mine, b"", 30, max_pages=2) == 2
    # the shared head is held by the live agent (not at risk: skipped), so the whole budget
    # went to this session's own tail
    retained = [p.page_id for p in m.pool.pages if p.retain_until > 0]
    assert retained == sorted(mine_pages[2:])
    assert all(m.pool.pages[i].retain_until == 0 for i in mine_pages[:2])
    m.check_integrity()
