"""Cache statistics: counters fed by events (:class:`CacheStatsCollector`), immutable snapshots
outside, and the snapshot's views of live sequences (shared prefixes, fragmentation).

Queries and hits are counted in TOKENS (vLLM's convention): a request with a 1,000-token prompt
adds 1,000 to ``query_tokens`` and the number of prompt tokens served from cached pages to
``hit_tokens``.

A **retention hit** is a hit on pages that were free AND under retention when the request came
(cache/retention.py): a returning turn whose prefix was kept ahead of the LRU for it.
``retention_hit_tokens`` is the part of ``hit_tokens`` those pages served; ``retention_hits``
counts the requests with any. It is an upper bound on what retention saved: without memory
pressure the LRU would have kept some of those pages anyway.
"""

from __future__ import annotations

from collections.abc import Collection, Iterable, Sequence
from dataclasses import dataclass, field, replace
from typing import Any, NamedTuple

from prefixgate.cache.events import (
    FreeList,
    PageCopied,
    PageEvicted,
    PrefixQueried,
    RetentionEnd,
    RetentionEnded,
    StatsEvent,
)
from prefixgate.cache.sequence import SequenceBlocks

OTHER_LABEL = "other"  # per-agent counters beyond max_tracked_agents are folded into this one


@dataclass(slots=True)
class HitCounter:
    """Prefix-cache queries/hits for one key (global, a tenant, or an agent)."""

    requests: int = 0
    query_tokens: int = 0
    hit_tokens: int = 0
    retention_hits: int = 0  # requests whose hit included retained free pages
    retention_hit_tokens: int = 0  # hit tokens served by those pages (part of hit_tokens)

    def record(self, query_tokens: int, hit_tokens: int, retention_hit_tokens: int = 0) -> None:
        self.requests += 1
        self.query_tokens += query_tokens
        self.hit_tokens += hit_tokens
        if retention_hit_tokens:
            self.retention_hits += 1
            self.retention_hit_tokens += retention_hit_tokens

    def add(self, other: HitCounter) -> None:
        """Sum ``other`` into this counter (folding labels together)."""
        self.requests += other.requests
        self.query_tokens += other.query_tokens
        self.hit_tokens += other.hit_tokens
        self.retention_hits += other.retention_hits
        self.retention_hit_tokens += other.retention_hit_tokens

    @property
    def hit_rate(self) -> float:
        return self.hit_tokens / self.query_tokens if self.query_tokens else 0.0

    def frozen(self) -> HitStats:
        return HitStats(self.requests, self.query_tokens, self.hit_tokens, self.retention_hits,
                        self.retention_hit_tokens)


@dataclass(frozen=True, slots=True)
class HitStats:
    requests: int
    query_tokens: int
    hit_tokens: int  # = prompt tokens saved from compute
    retention_hits: int = 0  # requests whose hit included retained free pages (module doc)
    retention_hit_tokens: int = 0  # hit tokens those retained pages served

    @property
    def hit_rate(self) -> float:
        return self.hit_tokens / self.query_tokens if self.query_tokens else 0.0

    def counts(self) -> list[int]:
        """Every counter, in field order (the fleet's Redis snapshots store this list)."""
        return [self.requests, self.query_tokens, self.hit_tokens, self.retention_hits,
                self.retention_hit_tokens]

    @classmethod
    def from_counts(cls, counts: Sequence[int]) -> HitStats:
        """The inverse of :meth:`counts`; older snapshots hold only the first three."""
        return cls(*(int(x) for x in counts))

    def __add__(self, other: HitStats) -> HitStats:
        """Counters summed (replicas of a fleet, labels folded together)."""
        return HitStats(*(a + b for a, b in zip(self.counts(), other.counts(), strict=True)))


@dataclass(frozen=True, slots=True)
class SharedPrefix:
    """A cached prefix that several live sequences reference right now."""

    token_ids: tuple[int, ...]  # the first tokens of the prefix (for display), at most 32
    num_tokens: int  # full length of the shared run, in tokens (whole blocks)
    num_sharers: int  # live sequences holding it
    tenant: str = "default"  # whose sequences share it (pages are never shared across tenants)


@dataclass(frozen=True, slots=True)
class CacheStats:
    """Immutable snapshot served by the gateway as JSON and Prometheus metrics.

    Page states partition the pool: ``pages_free + pages_cached_free + pages_used == num_pages``
    (pinned pages are counted in ``pages_used``; ``pages_pinned`` is a subset).
    """

    num_pages: int
    page_size: int
    pages_used: int  # refcount > 0
    pages_cached_free: int  # refcount 0 but hash registered: still hittable until reused
    pages_free: int  # refcount 0, no hash
    pages_pinned: int
    fragmentation: float  # allocated-but-unused slots / allocated slots, over live sequences
    evictions: int  # cached pages whose hash was dropped to reuse the page
    cow_copies: int
    num_sequences: int
    total: HitStats
    per_tenant: dict[str, HitStats] = field(default_factory=dict)
    per_agent: dict[str, HitStats] = field(default_factory=dict)  # summed over tenants
    # tenant -> agent -> hits: what one tenant's view lists (it sees only its own agents)
    per_tenant_agent: dict[str, dict[str, HitStats]] = field(default_factory=dict)
    # busiest first; up to the manager's top_k PER TENANT, so a tenant's view is never empty
    # just because other tenants share more
    top_prefixes: tuple[SharedPrefix, ...] = ()
    # retention (cache/retention.py): pages kept ahead of LRU eviction until a deadline
    pages_retained: int = 0  # under retention now (free or in use)
    retained_evicted: int = 0  # retained pages reused before their deadline (memory pressure)
    retention_expiries: int = 0  # retentions that ran out (their pages went back to the LRU)
    # retentions ended early: a tenant below its share took budget back from one past its own
    retention_reclaimed: int = 0
    retained_per_tenant: dict[str, int] = field(default_factory=dict)  # pages_retained by tenant
    # waiting requests' prefixes (BlockPool.hold): free cached pages protected for them now,
    # and protected pages reused anyway (nothing else was free: the hold lost its hit)
    pages_protected: int = 0
    protected_evicted: int = 0

    @property
    def usage(self) -> float:
        """Fraction of pages referenced by live sequences (vLLM's kv_cache_usage_perc)."""
        return self.pages_used / self.num_pages if self.num_pages else 0.0

    def for_tenant(self, tenant: str) -> CacheStats:
        """The snapshot one tenant may see: its own hit counters, agents and shared prefixes.

        Pool geometry and occupancy (pages, evictions, sequences) describe the shared server,
        not any tenant, and stay; every per-tenant and per-agent figure of other tenants goes,
        and ``total`` becomes this tenant's own (the global sum would reveal others' traffic).

        Args:
            tenant: the caller's tenant (from its API key).
        Returns:
            A copy with ``total``, ``per_tenant``, ``per_agent``, ``per_tenant_agent``,
            ``top_prefixes`` and ``retained_per_tenant`` restricted to ``tenant``.
        """
        own = self.per_tenant.get(tenant, HitStats(0, 0, 0))
        agents = dict(self.per_tenant_agent.get(tenant, {}))
        return replace(
            self,
            total=own,
            per_tenant={tenant: own} if tenant in self.per_tenant else {},
            per_agent=agents,
            per_tenant_agent={tenant: agents} if agents else {},
            top_prefixes=tuple(p for p in self.top_prefixes if p.tenant == tenant),
            retained_per_tenant={tenant: self.retained_per_tenant[tenant]}
            if tenant in self.retained_per_tenant else {},
        )


class Counters(NamedTuple):
    """The event-fed counters of a :class:`CacheStats` snapshot (field names as there)."""

    evictions: int
    cow_copies: int
    total: HitStats
    per_tenant: dict[str, HitStats]
    per_agent: dict[str, HitStats]
    per_tenant_agent: dict[str, dict[str, HitStats]]
    retained_evicted: int
    retention_expiries: int
    retention_reclaimed: int
    protected_evicted: int


class CacheStatsCollector:
    """Counts what the manager and the pool report (``cache.events.StatsEvent``).

    Args:
        max_tracked_agents: distinct (tenant, agent) labels kept before folding into the
            tenant's "other" (the cap bounds memory; the fold stays per tenant).
    """

    def __init__(self, max_tracked_agents: int = 1024) -> None:
        self.max_tracked_agents = max_tracked_agents
        self.total = HitCounter()
        self.per_tenant: dict[str, HitCounter] = {}
        # Keyed by (tenant, agent): a tenant's view lists only its own agents; the admin's
        # per-agent view sums a label over tenants.
        self.per_agent: dict[tuple[str, str], HitCounter] = {}
        self.cow_copies = 0
        self.evicted: dict[FreeList, int] = dict.fromkeys(FreeList, 0)
        self.retentions_ended: dict[RetentionEnd, int] = dict.fromkeys(RetentionEnd, 0)

    def record(self, event: StatsEvent) -> None:
        """Count one event (the manager's and the pool's stats sink)."""
        if isinstance(event, PageEvicted):
            self.evicted[event.source] += 1
        elif isinstance(event, PrefixQueried):
            self._record_query(event)
        elif isinstance(event, PageCopied):
            self.cow_copies += 1
        elif isinstance(event, RetentionEnded):
            self.retentions_ended[event.reason] += 1
        else:
            raise TypeError(f"not a stats event: {event!r}")

    def _record_query(self, event: PrefixQueried) -> None:
        query, hit, retained = event.query_tokens, event.hit_tokens, event.retention_hit_tokens
        self.total.record(query, hit, retained)
        self.per_tenant.setdefault(event.tenant, HitCounter()).record(query, hit, retained)
        if event.agent is not None:
            key = (event.tenant, event.agent)
            if key not in self.per_agent and len(self.per_agent) >= self.max_tracked_agents:
                key = (event.tenant, OTHER_LABEL)
            self.per_agent.setdefault(key, HitCounter()).record(query, hit, retained)

    def counters(self) -> Counters:
        """Every counter, frozen."""
        return Counters(
            evictions=sum(self.evicted.values()),
            cow_copies=self.cow_copies,
            total=self.total.frozen(),
            per_tenant={k: v.frozen() for k, v in self.per_tenant.items()},
            per_agent=self._agents_summed(),
            per_tenant_agent=self._agents_by_tenant(),
            retained_evicted=self.evicted[FreeList.RETAINED],
            retention_expiries=self.retentions_ended[RetentionEnd.EXPIRED],
            retention_reclaimed=self.retentions_ended[RetentionEnd.RECLAIMED],
            protected_evicted=self.evicted[FreeList.PROTECTED],
        )

    def _agents_summed(self) -> dict[str, HitStats]:
        summed: dict[str, HitCounter] = {}
        for (_, agent), counter in self.per_agent.items():
            summed.setdefault(agent, HitCounter()).add(counter)
        return {agent: counter.frozen() for agent, counter in summed.items()}

    def _agents_by_tenant(self) -> dict[str, dict[str, HitStats]]:
        by_tenant: dict[str, dict[str, HitStats]] = {}
        for (tenant, agent), counter in self.per_agent.items():
            by_tenant.setdefault(tenant, {})[agent] = counter.frozen()
        return by_tenant


def fragmentation(sequences: Iterable[SequenceBlocks], page_size: int) -> float:
    """Allocated-but-unused slots / allocated slots over the live sequences' pages (a shared
    page counts once, as full as its fullest holder)."""
    filled: dict[int, int] = {}
    for entry in sequences:
        computed = entry.seq.num_computed
        for b, page_id in enumerate(entry.block_table):
            n = min(page_size, max(0, computed - b * page_size))
            if n > filled.get(page_id, -1):
                filled[page_id] = n
    allocated = len(filled) * page_size
    return (allocated - sum(filled.values())) / allocated if allocated else 0.0


def top_prefixes(sequences: Iterable[SequenceBlocks], page_size: int,
                 top_k: int) -> tuple[SharedPrefix, ...]:
    """The ``top_k`` busiest prefixes of EACH tenant that live sequences share right now,
    busiest first overall."""
    # NOTE: grouped by tenant too, so a group never mixes tenants even if a hash collided
    # across salts; a tenant's view then filters by SharedPrefix.tenant alone.
    groups: dict[tuple[str, int], list[SequenceBlocks]] = {}
    for entry in sequences:
        if entry.num_registered and entry.block_table:
            groups.setdefault((entry.seq.tenant, entry.block_table[0]), []).append(entry)
    found = [_shared_prefix(tenant, members, page_size)
             for (tenant, _), members in groups.items() if len(members) >= 2]
    found.sort(key=lambda s: (s.num_sharers * s.num_tokens, s.num_sharers), reverse=True)
    per_tenant: dict[str, int] = {}
    kept = []
    for prefix in found:
        if per_tenant.get(prefix.tenant, 0) < top_k:
            per_tenant[prefix.tenant] = per_tenant.get(prefix.tenant, 0) + 1
            kept.append(prefix)
    return tuple(kept)


def _shared_prefix(tenant: str, members: list[SequenceBlocks], page_size: int) -> SharedPrefix:
    """The leading registered pages every member's block table holds."""
    length = min(m.num_registered for m in members)
    head = members[0].block_table
    shared = 0
    while shared < length and all(m.block_table[shared] == head[shared] for m in members):
        shared += 1
    return SharedPrefix(
        token_ids=tuple(members[0].seq.token_ids[: min(32, shared * page_size)]),
        num_tokens=shared * page_size,
        num_sharers=len(members),
        tenant=tenant,
    )


def snapshot(pool: Any, sequences: Collection[SequenceBlocks], retention: Any,
             collector: CacheStatsCollector, top_k: int) -> CacheStats:
    """The KV manager's stats: its pool's state now and the collector's counters (``pool``: a
    BlockPool; ``retention``: its TenantShareRetention)."""
    pages = pool.pages
    used = sum(1 for p in pages if p.ref_count > 0)
    cached_free = sum(1 for p in pages if p.ref_count == 0 and p.block_hash is not None)
    return CacheStats(
        num_pages=pool.num_pages,
        page_size=pool.page_size,
        pages_used=used,
        pages_cached_free=cached_free,
        pages_free=pool.num_pages - used - cached_free,
        pages_pinned=sum(1 for p in pages if p.pinned),
        fragmentation=fragmentation(sequences, pool.page_size),
        num_sequences=len(sequences),
        top_prefixes=top_prefixes(sequences, pool.page_size, top_k),
        pages_retained=sum(1 for p in pages if p.retain_until > 0),
        retained_per_tenant=retention.retained_per_tenant(pages),
        pages_protected=pool.num_protected_pages,
        **collector.counters()._asdict(),
    )
