"""The physical page pool: refcounts, LRU free queue, hash → page map, pins, lazy eviction.

A free page (refcount 0) sits in exactly one of three places, taken by allocation in this order:
  1. the LRU free queue (hashless pages at the front, cached ones from least recently used);
  2. the retained pages (cache/retention.py), earliest deadline first;
  3. the protected queue: cached pages a waiting request will hit (:meth:`BlockPool.hold`):
     the latest request's first (its admission is the furthest away), tail before head.
All three are soft: every free page stays allocatable, so neither ever blocks admission.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable

from prefixgate.cache.errors import InvalidArgumentError, OutOfPagesError
from prefixgate.cache.events import (
    BlockRemoved,
    BlockStored,
    EventSink,
    FreeList,
    PageEvicted,
    RetentionEnd,
    RetentionEnded,
    StatsSink,
)
from prefixgate.cache.free_queue import FreePageQueue
from prefixgate.cache.hashing import BlockHash, HashedBlock
from prefixgate.cache.page import Page
from prefixgate.cache.retention import RetainedPages


class BlockPool:
    """Owns every :class:`Page`; hands them out and takes them back.

    Args:
        num_pages: physical pages in the KV pool.
        page_size: tokens per page (for event payloads).
        enable_caching: when False no hash is ever registered (every lookup misses).
        event_sink: called with BlockStored / BlockRemoved as the hittable set changes.
        stats_sink: called with PageEvicted / RetentionEnded (cache.stats counts them).
    """

    def __init__(
        self,
        num_pages: int,
        page_size: int,
        *,
        enable_caching: bool = True,
        event_sink: EventSink | None = None,
        clock: Callable[[], float] = time.monotonic,
        stats_sink: StatsSink | None = None,
    ):
        if num_pages < 1:
            raise InvalidArgumentError(f"num_pages must be >= 1, got {num_pages}")
        if page_size < 1:
            raise InvalidArgumentError(f"page_size must be >= 1, got {page_size}")
        self.num_pages = num_pages
        self.page_size = page_size
        self.enable_caching = enable_caching
        self.pages = [Page(i) for i in range(num_pages)]
        self.free_queue = FreePageQueue(self.pages)
        self.cached: dict[BlockHash, Page] = {}
        self.event_sink = event_sink
        self.stats_sink = stats_sink
        # retention: free cached pages kept ahead of the LRU until a deadline (soft)
        self.retained = RetainedPages()
        self.clock = clock
        # waiting requests' prefixes: block hash -> how many waiting requests hold it. A free page
        # under a held hash sits in ``protected``: a queued request keeps its hit while it waits
        self._held: dict[BlockHash, int] = {}
        self.protected = FreePageQueue()
        # called with (page id, its block) when a cached page is evicted for reuse, before its
        # K/V is overwritten (the second tier copies it out: engine/kv_tier.py)
        self.evict_sink: Callable[[int, HashedBlock], None] | None = None

    @property
    def num_free_pages(self) -> int:
        """Pages with refcount 0 (free or free-but-cached, retained or not): what allocation
        can take. NOTE: neither retention nor protection makes a page unallocatable."""
        return len(self.free_queue) + len(self.retained) + len(self.protected)

    @property
    def num_retained_pages(self) -> int:
        """Free cached pages under retention right now (referenced pages are not counted)."""
        return len(self.retained)

    @property
    def num_protected_pages(self) -> int:
        """Free cached pages a waiting request holds (:meth:`hold`)."""
        return len(self.protected)

    def free_pages(self) -> list[Page]:
        """Every free page, in the order allocation takes them: the LRU queue, the retained
        ones, the protected ones."""
        return [*self.free_queue, *self.retained, *self.protected]

    def is_held(self, block_hash: BlockHash) -> bool:
        """Whether a waiting request holds ``block_hash`` (see :meth:`hold`)."""
        return block_hash in self._held

    def held_counts(self) -> dict[BlockHash, int]:
        """Held hash -> how many waiting requests hold it (a copy, for integrity checks)."""
        return dict(self._held)

    def _expire(self) -> None:
        for page in self.retained.pop_expired(self.clock()):
            self._end_retention(page, RetentionEnd.EXPIRED)
            self.free_queue.append(page)  # back to the ordinary LRU, most recent end

    def _enqueue_free(self, page: Page, newly_held: bool = False) -> None:
        """Put a page that just became free (or changed protection) where it belongs.

        ``newly_held``: :meth:`hold` walks a prefix head to tail, so each page goes to the
        front (the tail, and the latest request, evicted first); a released page goes to the
        back (``free`` releases tail first: its tail is evicted before its head)."""
        if page.block_hash is None:
            self.free_queue.appendleft(page)  # nobody can hit it: reused first
        elif page.block_hash in self._held:
            page.protected = True
            if newly_held:
                self.protected.appendleft(page)
            else:
                self.protected.append(page)
        elif page.retain_until > self.clock():
            self.retained.add(page)
        else:
            _clear_retention(page)
            self.free_queue.append(page)

    def _dequeue_free(self, page: Page) -> None:
        """Take a free page out of whichever queue holds it."""
        if page.protected:
            page.protected = False
            self.protected.remove(page)
        elif page in self.retained:
            self.retained.remove(page)
        else:
            self.free_queue.remove(page)

    def allocate(self, count: int) -> list[Page]:
        """Take ``count`` pages from the front of the free queue, each with refcount 1.

        A page that was free-but-cached loses its hash here (lazy eviction).

        Raises:
            OutOfPagesError: fewer than ``count`` pages are free (nothing is taken).
        """
        if count < 0:
            raise InvalidArgumentError(f"cannot allocate {count} pages")
        if count > self.num_free_pages:
            raise OutOfPagesError(count, self.num_free_pages)
        if self.retained:
            self._expire()
        out = []
        for _ in range(count):
            page, source = self._take_free()
            if page.block_hash is not None:
                self._evict(page, source)
            page.ref_count = 1
            out.append(page)
        return out

    def _take_free(self) -> tuple[Page, FreeList]:
        """The next free page in taking order (the module doc), out of its queue."""
        if self.free_queue:
            return self.free_queue.popleft(), FreeList.LRU
        if self.retained:  # only retained or protected pages left: earliest deadline first
            page = self.retained.pop_earliest()
            _clear_retention(page)
            return page, FreeList.RETAINED
        # NOTE: protection is soft: a waiting request's hit goes last, but it goes
        page = self.protected.popleft()
        page.protected = False
        return page, FreeList.PROTECTED

    def lookup(self, block: HashedBlock) -> Page | None:
        """The cached page holding exactly ``block``, or None.

        NOTE: a hash match is never trusted alone; the page's stored parent hash, token ids and
        extra keys must equal the request's, so even a forced collision cannot serve wrong KV.
        """
        page = self.cached.get(block.block_hash)
        if page is None:
            return None
        if (
            page.parent_hash != block.parent_hash
            or page.token_bytes != block.token_bytes
            or page.extra_keys != block.extra_keys
        ):
            return None
        return page

    def touch(self, pages: Iterable[Page]) -> None:
        """Add one reference to each page (a new block table holds it)."""
        for page in pages:
            if page.ref_count == 0:
                self._dequeue_free(page)
            if page.retain_ttl:  # a hit on a retained prefix: its session is back, keep it longer
                page.retain_until = max(page.retain_until, self.clock() + page.retain_ttl)
            page.ref_count += 1

    def release(self, pages: Iterable[Page]) -> None:
        """Drop one reference from each page, in the given order.

        Pages reaching refcount 0 join the free queue in that order: cached pages at the back
        (LRU), hashless pages at the front (reused first, no one can hit them); retained ones
        join the retained pages, held ones the protected queue.
        """
        for page in pages:
            if page.ref_count <= 0:
                raise InvalidArgumentError(f"release of page {page.page_id} with refcount {page.ref_count}")
            page.ref_count -= 1
            if page.ref_count == 0:
                self._enqueue_free(page)

    def retain(self, page: Page, ttl_s: float, tenant: str = "default") -> bool:
        """Keep cached ``page`` ahead of LRU eviction for ``ttl_s`` seconds from now (a later
        deadline is kept); a hit renews it. ``tenant``'s retention budget pays for it. Returns
        False for a page without a hash."""
        if page.block_hash is None or ttl_s <= 0:
            return False
        page.retain_until = max(page.retain_until, self.clock() + ttl_s)
        page.retain_ttl = max(page.retain_ttl, ttl_s)
        page.retain_tenant = tenant
        if page.ref_count == 0 and not page.protected:  # re-queued under its new deadline
            self._dequeue_free(page)
            self.retained.add(page)
        return True

    def unretain(self, page: Page) -> bool:
        """End ``page``'s retention now (its budget is given back): a free page goes back to
        the ordinary LRU, at its most recent end. False if it was not retained."""
        if page.retain_until <= 0:
            return False
        in_retained = page.ref_count == 0 and not page.protected
        self._end_retention(page, RetentionEnd.RECLAIMED)
        if in_retained:
            self.retained.remove(page)
            self.free_queue.append(page)
        return True

    def hold(self, hashes: Iterable[BlockHash]) -> None:
        """A waiting request will hit these blocks: protect their free pages from eviction
        (after every other free page) until :meth:`unhold`. Counted: several requests may hold
        one hash. A hash with no page yet protects the page that later caches it.

        NOTE: soft, like retention: protected pages stay free and allocatable, so a hold can
        never block an admission or deadlock the queue it protects.
        """
        for block_hash in hashes:
            count = self._held.get(block_hash, 0)
            self._held[block_hash] = count + 1
            page = self.cached.get(block_hash) if count == 0 else None
            if page is not None and page.ref_count == 0:
                self._dequeue_free(page)
                self._enqueue_free(page, newly_held=True)

    def unhold(self, hashes: Iterable[BlockHash]) -> None:
        """Undo one :meth:`hold` of each hash: an unprotected free page returns to the retained
        pages or to the LRU's most recent end (a request just wanted it)."""
        for block_hash in hashes:
            count = self._held[block_hash] - 1
            if count:
                self._held[block_hash] = count
                continue
            del self._held[block_hash]
            page = self.cached.get(block_hash)
            if page is not None and page.protected:
                self._dequeue_free(page)
                self._enqueue_free(page)

    def register(self, page: Page, block: HashedBlock) -> bool:
        """Make ``page`` hittable under ``block``'s hash.

        Returns False (page stays unhashed) when caching is off or the hash is already held by
        another page: the same content computed twice keeps one cached copy, and a colliding
        block never overwrites a verified entry.
        """
        if not self.enable_caching or page.block_hash is not None:
            return False
        if block.block_hash in self.cached:
            return False
        page.block_hash = block.block_hash
        page.parent_hash = block.parent_hash
        page.token_bytes = block.token_bytes
        page.extra_keys = block.extra_keys
        self.cached[block.block_hash] = page
        if self.event_sink is not None:
            self.event_sink(BlockStored(block.block_hash, block.parent_hash, self.page_size,
                                        block.token_bytes, block.extra_keys))
        return True

    def pin(self, page: Page) -> bool:
        """Keep ``page`` resident (+1 refcount). Returns False if it was already pinned."""
        if page.pinned:
            return False
        self.touch((page,))
        page.pinned = True
        return True

    def unpin(self, page: Page) -> bool:
        """Undo :meth:`pin`. Returns False if the page was not pinned."""
        if not page.pinned:
            return False
        page.pinned = False
        self.release((page,))
        return True

    def reset(self) -> int:
        """Drop the hash of every free-but-cached page; returns how many were dropped."""
        dropped = 0
        for page in [*self.free_queue, *self.retained, *self.protected]:
            if page.block_hash is not None:
                self.drop_hash(page)
                dropped += 1
        return dropped

    def drop_hash(self, page: Page) -> None:
        """Make ``page`` unhittable now (its K/V is not what its hash says, or the cache is
        reset); a free page moves to the front of the LRU, where hashless pages belong."""
        if page.ref_count == 0:
            self._dequeue_free(page)
        self._drop_hash(page)
        if page.ref_count == 0:
            self.free_queue.appendleft(page)

    def cached_hashes(self) -> list[BlockHash]:
        """Every hittable hash (for a full resync of an external index)."""
        return list(self.cached)

    def _end_retention(self, page: Page, reason: RetentionEnd) -> None:
        _clear_retention(page)
        if self.stats_sink is not None:
            self.stats_sink(RetentionEnded(page.page_id, reason))

    def _evict(self, page: Page, source: FreeList) -> None:
        if self.stats_sink is not None:
            self.stats_sink(PageEvicted(page.page_id, source))
        if self.evict_sink is not None:  # the second tier: spill the page before its reuse
            assert page.block_hash is not None and page.parent_hash is not None
            self.evict_sink(page.page_id, HashedBlock(page.block_hash, page.parent_hash,
                                                      page.token_bytes or b"", page.extra_keys))
        self._drop_hash(page)

    def _drop_hash(self, page: Page) -> None:
        block_hash = page.block_hash
        assert block_hash is not None
        del self.cached[block_hash]
        page.block_hash = page.parent_hash = page.token_bytes = None
        page.extra_keys = b""
        _clear_retention(page)
        if self.event_sink is not None:
            self.event_sink(BlockRemoved(block_hash))


def _clear_retention(page: Page) -> None:
    page.retain_until = page.retain_ttl = 0.0
    page.retain_tenant = None
