"""Retention in the page pool (cache/block_pool.py, cache/retention.py): soft, deadline-ordered.

Retained free pages are evicted only after every unretained free page, earliest deadline
first; they never block an allocation; an expired retention returns the page to the LRU; a hit
renews the deadline; a budget bounds how much is retained."""

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
    return len(manager._cached_prefix_pages(tokens, b""))


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
