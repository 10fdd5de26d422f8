"""The KV manager's page sharing and copy-on-write: a fork shares every page of its parent, a
prefix hit shares cached pages, and a write into a shared or cached page copies it first
(invariant 3 of docs/design.md: a written page has refcount 1 and no hash)."""

from __future__ import annotations

from collections.abc import Callable

from prefixgate.cache.block_pool import BlockPool
from prefixgate.cache.events import PageCopied, StatsEvent
from prefixgate.cache.prefix_lookup import PrefixMatch
from prefixgate.cache.sequence import CacheSequence, SequenceBlocks


class CopyOnWrite:
    """Plans and makes the private pages of a sequence's next writes, and shares on forks.

    Args:
        pool: the manager's block pool.
        record: the stats collector's sink (a ``PageCopied`` per copy).
    """

    def __init__(self, pool: BlockPool, record: Callable[[StatsEvent], None]) -> None:
        self.pool = pool
        self.page_size = pool.page_size
        self._record = record

    def pages_for_prompt(self, num_tokens: int, match: PrefixMatch) -> int:
        """Free pages that allocating and fully computing a prompt with hit ``match`` takes."""
        total_blocks = -(-num_tokens // self.page_size)
        hit_pages = len(match.page_ids)
        cow = 1 if match.num_cached_tokens < hit_pages * self.page_size else 0
        return total_blocks - hit_pages + cow + match.num_free_hit_pages

    def plan(self, entry: SequenceBlocks, num_new_tokens: int) -> tuple[list[int], int]:
        """(blocks that need a copy-on-write, number of fresh pages) for the next n positions."""
        ps, table = self.page_size, entry.block_table
        first = entry.seq.num_computed // ps
        last = (entry.seq.num_computed + num_new_tokens - 1) // ps
        cow = []
        for b in range(first, min(last + 1, len(table))):
            page = self.pool.pages[table[b]]
            if page.ref_count > 1 or page.block_hash is not None:
                cow.append(b)
        return cow, max(0, last + 1 - len(table))

    def make_private(self, entry: SequenceBlocks, cow_blocks: list[int],
                     num_new_pages: int) -> list[tuple[int, int]]:
        """Copy ``cow_blocks`` into fresh pages and append ``num_new_pages`` (the caller checked
        there are enough free); returns the ``(src, dst)`` copies the runner must make."""
        pairs: list[tuple[int, int]] = []
        for block_index in cow_blocks:
            old = self.pool.pages[entry.block_table[block_index]]
            (new,) = self.pool.allocate(1)
            entry.block_table[block_index] = new.page_id
            self.pool.release((old,))
            pairs.append((old.page_id, new.page_id))
            self._record(PageCopied(old.page_id, new.page_id))
        for page in self.pool.allocate(num_new_pages):
            entry.block_table.append(page.page_id)
        return pairs

    def share(self, parent: SequenceBlocks, child: CacheSequence) -> SequenceBlocks:
        """``child``'s table sharing every page of ``parent`` (partial tail included); the
        child gets the parent's hash chain and computed count."""
        self.pool.touch(self.pool.pages[i] for i in parent.block_table)
        child.block_hashes[:] = parent.seq.block_hashes
        child.num_computed = parent.seq.num_computed
        return SequenceBlocks(child, list(parent.block_table), parent.num_registered)
