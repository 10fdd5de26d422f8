"""Cache statistics: mutable counters inside the manager, immutable snapshots outside.

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

from collections.abc import Sequence
from dataclasses import dataclass, field, replace


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
