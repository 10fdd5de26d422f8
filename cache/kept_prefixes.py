"""The KV manager's kept prefixes: cached pages kept past plain LRU eviction. Pins (hard: never
evicted), retention (soft: a deadline and tenant budgets, cache/retention.py decides which
pages) and holds (soft: a waiting request keeps its hit). The mechanism of each is the pool's;
this keeps the manager's side: which prefix, whose budget, which waiting request."""

from __future__ import annotations

from collections.abc import Callable, Hashable, Sequence

from prefixgate.cache.block_pool import BlockPool
from prefixgate.cache.hashing import BlockHash, HashedBlock
from prefixgate.cache.page import Page
from prefixgate.cache.retention import TenantShareRetention


class KeptPrefixes:
    """Pins, retentions and holds of one pool.

    Args:
        pool: the manager's block pool.
        prefix_pages: the cached pages of a prompt's full-block prefix (token ids, extra keys).
    """

    def __init__(self, pool: BlockPool,
                 prefix_pages: Callable[[Sequence[int], bytes], list[Page]]) -> None:
        self.pool = pool
        self._prefix_pages = prefix_pages
        self.retention = TenantShareRetention()  # which pages retain() may keep (the policy)
        self.holds: dict[Hashable, tuple[BlockHash, ...]] = {}  # waiting request -> its hashes

    # ------------------------------------------------------------------ pins

    def pin(self, token_ids: Sequence[int], extra_keys: bytes) -> int:
        """``KVCacheManager.pin``: pin the cached full blocks of the prefix; how many."""
        pages = self._prefix_pages(token_ids, extra_keys)
        for page in pages:
            self.pool.pin(page)
        return len(pages)

    def unpin(self, token_ids: Sequence[int], extra_keys: bytes) -> int:
        """``KVCacheManager.unpin``: how many of the prefix's pages were pinned."""
        return sum(self.pool.unpin(p) for p in self._prefix_pages(token_ids, extra_keys))

    def num_pinned(self, token_ids: Sequence[int], extra_keys: bytes) -> int:
        """How many leading full blocks of ``token_ids`` are cached and pinned right now."""
        return sum(1 for p in self._prefix_pages(token_ids, extra_keys) if p.pinned)

    # ------------------------------------------------------------------ retention

    def retain(self, token_ids: Sequence[int], extra_keys: bytes, ttl_s: float, tenant: str,
               max_pages: int | None, max_tenant_pages: int | None) -> int:
        """Retain the cached full blocks of ``token_ids``'s prefix for ``ttl_s`` seconds: they
        are evicted only after every unretained free page (earliest deadline first), and a hit
        renews them. Soft: they never block an allocation. Pins are untouched by budgets.

        Args:
            max_pages: the global retention budget (pages retained in the whole pool).
            tenant: whose budget pays; pages it already retains count against it.
            max_tenant_pages: the tenant's share of the global budget: guaranteed, not a cap.
                While the global budget has room a tenant may retain past its share; once it
                is full, a tenant below its share takes pages back from tenants past theirs
                (their earliest deadlines first, back to the LRU), and a tenant at or past its
                share retains nothing more. Without ``max_pages`` the share is a plain cap.
                Blocks left out go to the LRU; renewing a retained page costs no budget.

        NOTE: a share is work-conserving because a hard per-tenant cap left most of the
        retention budget idle whenever one tenant ran the swarm (benchmarks.agent_sessions: a
        single tenant held 25% of the pool retained while half was allowed, and retention
        saved almost nothing); reclaiming keeps the guarantee that one tenant's paused sessions
        cannot take the budget from the others.

        NOTE: walked from the conversation's tail back to its head, and pages other live
        sequences hold are skipped: the head is usually a system prompt every agent shares,
        referenced or hit all the time (the LRU keeps it anyway), while the tail is this
        session's own history, the first thing the LRU evicts (sequences release tail first).
        Walked head first, the shared prefix alone used up a tenant's budget and no session's
        own pages were ever retained (benchmarks.agent_sessions found it).

        Returns:
            How many pages are retained now for this prefix.
        """
        pages = self._prefix_pages(token_ids, extra_keys)
        return self.retention.retain(self.pool, pages, ttl_s, tenant, max_pages, max_tenant_pages)

    def num_retained(self, tenant: str | None) -> int:
        """Pages under retention (free retained ones plus referenced ones with a deadline),
        only those ``tenant`` pays for unless None."""
        if tenant is None:
            return sum(1 for p in self.pool.pages if p.retain_until > 0)
        return sum(1 for p in self.pool.pages if p.retain_until > 0 and p.retain_tenant == tenant)

    def retention_hit_tokens(self, pages: Sequence[Page], num_cached_tokens: int) -> int:
        """Hit tokens on pages that were free and under an unexpired retention (a returning
        turn whose prefix retention kept). NOTE: the hit stops one token short of a whole
        prompt (invariant 5); count before the hit takes the pages out of the retained set."""
        now, hit, ps = self.pool.clock(), 0, self.pool.page_size
        for index, page in enumerate(pages):
            # NOTE: free with an unexpired deadline = retained (or protected on top of it)
            if page.ref_count == 0 and page.retain_until > now:
                hit += max(0, min(ps, num_cached_tokens - index * ps))
        return hit

    # ------------------------------------------------------------------ holds

    def hold(self, key: Hashable, blocks: Sequence[HashedBlock]) -> None:
        """A waiting request keeps its hit (``KVCacheManager.hold_prefix``): the free pages
        caching any of ``blocks`` are evicted only after every other free page, until
        :meth:`release` (soft: they stay allocatable, see ``BlockPool.hold``). Holding again
        under ``key`` replaces the hold.

        Args:
            key: the waiting request (its sequence id); not a live sequence of the manager.
            blocks: its full-block hash chain (blocks not cached yet protect the page that
                caches them later: another request may be computing them).
        """
        self.release(key)
        hashes = tuple(b.block_hash for b in blocks)
        self.holds[key] = hashes
        self.pool.hold(hashes)

    def release(self, key: Hashable) -> None:
        """End ``key``'s hold; no-op without one."""
        hashes = self.holds.pop(key, None)
        if hashes is not None:
            self.pool.unhold(hashes)

    def release_all(self) -> None:
        """End every hold."""
        for key in list(self.holds):
            self.release(key)
