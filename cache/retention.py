"""Retained free pages: cached pages kept ahead of LRU eviction until a deadline (a session
waiting on a tool, an Anthropic ``cache_control`` breakpoint).

Soft, never a lock: a retained page is still free (allocatable, counted in the free pages); the
allocator takes every unretained free page first, then retained ones earliest deadline first.
An expired retention returns its page to the ordinary LRU queue.
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Iterator, Sequence
from typing import TYPE_CHECKING

from prefixgate.cache.page import Page

if TYPE_CHECKING:  # the pool holds a RetainedPages: import it for types only
    from prefixgate.cache.block_pool import BlockPool


class RetainedPages:
    """Free cached pages ordered by retention deadline (a heap with lazy deletion).

    Shares the page's ``in_free_queue`` flag with :class:`FreePageQueue`: a free page is in
    exactly one of the two.
    """

    def __init__(self) -> None:
        self._pages: dict[int, Page] = {}
        self._heap: list[tuple[float, int, int]] = []  # (deadline, tie-break, page id)
        self._order = itertools.count()

    def __len__(self) -> int:
        return len(self._pages)

    def __iter__(self) -> Iterator[Page]:
        return iter(list(self._pages.values()))

    def __contains__(self, page: Page) -> bool:
        return self._pages.get(page.page_id) is page

    def add(self, page: Page) -> None:
        assert not page.in_free_queue and page.retain_until > 0, page
        self._pages[page.page_id] = page
        page.in_free_queue = True
        heapq.heappush(self._heap, (page.retain_until, next(self._order), page.page_id))

    def remove(self, page: Page) -> None:
        del self._pages[page.page_id]
        page.in_free_queue = False  # its heap entry is skipped when it surfaces

    def _peek(self) -> Page | None:
        while self._heap:
            deadline, _, page_id = self._heap[0]
            page = self._pages.get(page_id)
            if page is not None and page.retain_until == deadline:
                return page
            heapq.heappop(self._heap)  # removed, or re-added with another deadline
        return None

    def pop_earliest(self) -> Page:
        """The page whose retention ends first (removed). Raises IndexError when empty."""
        page = self._peek()
        if page is None:
            raise IndexError("no retained page")
        self.remove(page)
        return page

    def pop_expired(self, now: float) -> Iterator[Page]:
        """Remove and yield every page whose deadline is at or before ``now``."""
        while (page := self._peek()) is not None and page.retain_until <= now:
            self.remove(page)
            yield page


class TenantShareRetention:
    """The retention policy: which pages of a prefix a retention request may keep, under a
    global budget and a work-conserving per-tenant share (``KVCacheManager.retain`` documents
    the contract). Mechanism stays in the pool (``BlockPool.retain`` / ``unretain``); this
    only decides."""

    def retain(self, pool: BlockPool, pages: Sequence[Page], ttl_s: float, tenant: str,
               max_pages: int | None, max_tenant_pages: int | None) -> int:
        """Retain ``pages`` (a prefix, head first) tail first within the budgets; returns how
        many are retained now."""
        held = self.retained_per_tenant(pool.pages)
        total = sum(held.values())
        lenders: list[Page] | None = None  # reclaim candidates, made on first need
        retained = 0
        for page in reversed(pages):
            if page.ref_count > 0 and page.retain_until <= 0:
                continue  # in use by another sequence: not at risk, not worth a budget slot
            if page.retain_until <= 0:
                mine = held.get(tenant, 0)
                share_left = max_tenant_pages is None or mine < max_tenant_pages
                if max_pages is not None and total >= max_pages:
                    if max_tenant_pages is None or not share_left:
                        break
                    if lenders is None:
                        lenders = sorted((p for p in pool.pages
                                          if p.retain_until > 0 and p.retain_tenant != tenant),
                                         key=lambda p: p.retain_until, reverse=True)
                    if not self._reclaim_one(pool, lenders, held, max_tenant_pages):
                        break
                    total -= 1
                elif max_pages is None and not share_left:
                    break
                held[tenant] = mine + 1
                total += 1
            retained += pool.retain(page, ttl_s, tenant)
        return retained

    @staticmethod
    def _reclaim_one(pool: BlockPool, lenders: list[Page], held: dict[str, int], share: int) -> bool:
        """End the retention of the earliest-deadline page of a tenant past ``share`` (popped
        from ``lenders``, sorted latest deadline first); False when no tenant is past it."""
        while lenders:
            page = lenders.pop()
            owner = page.retain_tenant
            if owner is None or page.retain_until <= 0 or held.get(owner, 0) <= share:
                continue
            pool.unretain(page)
            held[owner] -= 1
            return True
        return False

    @staticmethod
    def retained_per_tenant(pages: Sequence[Page]) -> dict[str, int]:
        """Pages under retention (free or in use), per paying tenant."""
        held: dict[str, int] = {}
        for page in pages:
            if page.retain_until > 0 and page.retain_tenant is not None:
                held[page.retain_tenant] = held.get(page.retain_tenant, 0) + 1
        return held
