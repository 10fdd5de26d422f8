"""The KV manager's second-tier half: evicted cached pages recorded for the connector (it
copies them out before the step's writes reuse them), and verified blocks loaded from the tier
installed in pages of their own (engine/kv_connector.py drives both)."""

from __future__ import annotations

from collections.abc import Callable, Hashable, Sequence

from prefixgate.cache.block_pool import BlockPool
from prefixgate.cache.hashing import BlockHash, HashedBlock
from prefixgate.cache.page import Page


class TierPages:
    """Evictions and installs of one pool.

    Args:
        pool: the manager's block pool.
        watermark_pages: installs leave at least this many pages free.
        holders: the live sequences holding any of a set of pages (the manager's tables).
    """

    def __init__(self, pool: BlockPool, watermark_pages: int,
                 holders: Callable[[set[int]], set[Hashable]]) -> None:
        self.pool = pool
        self.watermark_pages = watermark_pages
        self._holders = holders
        self._evicted: list[tuple[int, HashedBlock]] = []  # see capture()
        self._evicted_hashes: set[BlockHash] = set()  # the same blocks, by hash
        self._unwritten: set[int] = set()  # installed from the tier, load not written yet

    def capture(self) -> None:
        """Start recording evicted cached pages (page id, block) for :meth:`take_evicted`: the
        second tier copies them out before the step's writes reuse them."""
        self.pool.evict_sink = self._on_evict

    def _on_evict(self, page_id: int, block: HashedBlock) -> None:
        if page_id in self._unwritten:
            # NOTE: installed this step and evicted again before its load was written: the
            # pool does not hold that block's K/V yet, so there is nothing true to spill
            self._unwritten.discard(page_id)
            return
        self._evicted.append((page_id, block))
        self._evicted_hashes.add(block.block_hash)

    def evicted_since_taken(self, block_hash: BlockHash) -> bool:
        """Whether ``block_hash`` was evicted since the last :meth:`take_evicted`: its K/V is on
        its way to the second tier but not there yet."""
        return block_hash in self._evicted_hashes

    def take_evicted(self) -> list[tuple[int, HashedBlock]]:
        """Pages evicted since the last call, in eviction order."""
        evicted, self._evicted = self._evicted, []
        self._evicted_hashes.clear()
        return evicted

    def loads_written(self) -> None:
        """The step's tier loads are in their pages: its install window ends."""
        self._unwritten.clear()

    def forget_unwritten(self) -> set[Hashable]:
        """Un-cache pages installed from the tier whose load was never written (a step that
        failed in between): their hashes would serve whatever K/V the pages held. Returns
        the live sequences holding any of them (see :meth:`forget_pages`)."""
        unwritten, self._unwritten = self._unwritten, set()
        return self.forget_pages(sorted(unwritten)) if unwritten else set()

    def forget_pages(self, page_ids: Sequence[int]) -> set[Hashable]:
        """Drop the hashes of ``page_ids`` (their K/V is not what the hash says); returns the
        live sequences holding any of them, which the caller must fail."""
        doomed = set(page_ids)
        for page_id in doomed:
            page = self.pool.pages[page_id]
            if page.block_hash is not None:
                self.pool.drop_hash(page)
        return self._holders(doomed)

    def install(self, blocks: Sequence[HashedBlock], max_pages: int,
                keep: Sequence[int] = ()) -> list[int]:
        """Give verified blocks loaded from the second tier pages of their own, registered
        under their hashes, free-but-cached (refcount 0) so the request's lookup hits them.

        NOTE: the pages hold their K/V only once the runner writes the load, which the
        connector does before the step's forward (the first read), then calls
        :meth:`loads_written`; a step that fails before that calls :meth:`forget_unwritten`.

        Args:
            blocks: consecutive blocks continuing a cached prefix (block i's parent is i-1's).
            max_pages: at most this many pages (what admission can spare).
            keep: pages that must survive the install: the pool hit ``blocks`` continue (free
                hit pages sit in the LRU queue like any other; taking one would cut the chain
                the loaded blocks hang from).
        Returns:
            The page ids, in block order; stops early at a block someone cached meanwhile.
        """
        if not self.pool.enable_caching:
            return []
        held = [self.pool.pages[i] for i in keep]
        self.pool.touch(held)
        try:
            room = min(len(blocks), max_pages, self.pool.num_free_pages - self.watermark_pages)
            pages: list[Page] = []
            for block in blocks[: max(room, 0)]:
                if block.block_hash in self.pool.cached:
                    break
                (page,) = self.pool.allocate(1)
                self.pool.register(page, block)
                pages.append(page)
        finally:
            self.pool.release(reversed(held))
        self._unwritten.update(p.page_id for p in pages)
        self.pool.release(reversed(pages))  # tail first, as free() does: heads outlive tails
        return [p.page_id for p in pages]
