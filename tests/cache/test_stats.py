import pytest

from prefixgate.cache.events import (
    FreeList,
    PageCopied,
    PageEvicted,
    PrefixQueried,
    RetentionEnd,
    RetentionEnded,
)
from prefixgate.cache.stats import OTHER_LABEL, CacheStatsCollector, HitStats


def test_the_collector_counts_every_event_kind():
    c = CacheStatsCollector(max_tracked_agents=2)
    c.record(PrefixQueried("alpha", "coder", 100, 64, 32))
    c.record(PrefixQueried("alpha", "coder", 10, 0))  # a miss
    c.record(PrefixQueried("alpha", "tester", 10, 0))
    c.record(PrefixQueried("beta", "coder", 50, 16))  # a third label: folded into beta's other
    c.record(PrefixQueried("beta", None, 5, 0))  # no agent: tenant and total only
    c.record(PageCopied(1, 2))
    for source in (FreeList.LRU, FreeList.LRU, FreeList.RETAINED, FreeList.PROTECTED):
        c.record(PageEvicted(7, source))
    c.record(RetentionEnded(3, RetentionEnd.EXPIRED))
    c.record(RetentionEnded(4, RetentionEnd.RECLAIMED))
    c.record(RetentionEnded(5, RetentionEnd.RECLAIMED))
    got = c.counters()
    assert got.total == HitStats(5, 175, 80, 1, 32)
    assert got.per_tenant == {"alpha": HitStats(3, 120, 64, 1, 32), "beta": HitStats(2, 55, 16)}
    assert got.per_tenant_agent == {
        "alpha": {"coder": HitStats(2, 110, 64, 1, 32), "tester": HitStats(1, 10, 0)},
        "beta": {OTHER_LABEL: HitStats(1, 50, 16)},
    }
    assert got.per_agent["coder"] == HitStats(2, 110, 64, 1, 32)
    assert (got.cow_copies, got.evictions, got.retained_evicted, got.protected_evicted) == (1, 4, 1, 1)
    assert (got.retention_expiries, got.retention_reclaimed) == (1, 2)
    with pytest.raises(TypeError, match="not a stats event"):
        c.record("hit")  # type: ignore[arg-type]
