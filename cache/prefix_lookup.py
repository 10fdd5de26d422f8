"""The KV manager's prefix lookup: which leading blocks of a chain are cached (verified), and
which blocks right after a hit some live sequence is computing now (in-flight dedup)."""

from __future__ import annotations

from collections.abc import Callable, Hashable, Sequence
from typing import NamedTuple

from prefixgate.cache.block_pool import BlockPool
from prefixgate.cache.hashing import BlockHasher, HashedBlock
from prefixgate.cache.page import Page
from prefixgate.cache.state_group import StateGroup


class PrefixMatch(NamedTuple):
    """Result of a prefix lookup (no side effects)."""

    num_cached_tokens: int  # usable hit, capped so the last prompt token is always computed
    page_ids: tuple[int, ...]  # pages of the hit, in block order
    num_pending_tokens: int  # tokens right after the hit that another live sequence is computing
    num_free_hit_pages: int  # hit pages at refcount 0 (taking them uses free pages)


NO_MATCH = PrefixMatch(0, (), 0, 0)


class PrefixLookup:
    """Prefix hits in one pool, and the blocks live sequences will compute.

    Args:
        pool: the manager's block pool.
        hasher: the manager's block hasher.
        state: the recurrent-state group (a hybrid model's hit ends at a checkpoint), or None.
        computed: a live sequence's computed prefix (tokens), None when it is not live.
    """

    def __init__(self, pool: BlockPool, hasher: BlockHasher, state: StateGroup | None,
                 computed: Callable[[Hashable], int | None]) -> None:
        self.pool = pool
        self.hasher = hasher
        self.page_size = pool.page_size
        self._state = state
        self._computed = computed
        # In-flight prefix dedup: hash of a block some live sequence will compute -> that sequence.
        self._pending: dict[bytes, Hashable] = {}

    def mark_pending(self, blocks: Sequence[HashedBlock], seq_id: Hashable) -> None:
        """``seq_id`` will compute ``blocks`` (those nobody else computes already)."""
        for block in blocks:
            self._pending.setdefault(block.block_hash, seq_id)

    def drop_pending(self, blocks: Sequence[HashedBlock], seq_id: Hashable) -> None:
        """``seq_id`` will not compute ``blocks`` any more (freed)."""
        for block in blocks:
            if self._pending.get(block.block_hash) == seq_id:
                del self._pending[block.block_hash]

    def cached_pages(self, blocks: Sequence[HashedBlock]) -> list[Page]:
        """The pages caching the leading ``blocks`` (verified), in block order."""
        pages = []
        for block in blocks:
            page = self.pool.lookup(block)
            if page is None:
                break
            pages.append(page)
        return pages

    def cached_prefix_pages(self, token_ids: Sequence[int], extra_keys: bytes) -> list[Page]:
        """:meth:`cached_pages` of ``token_ids``'s full blocks."""
        return self.cached_pages(self.hasher.hash_blocks(token_ids, extra_keys))

    def count_cached(self, blocks: Sequence[HashedBlock], hint: int = 0) -> int:
        """Leading ``blocks`` cached in the pool (verified), for ordering waiting requests.

        Args:
            hint: a previous count for the same chain; when its last block is still cached the
                walk resumes there (a held prefix rarely shrinks), else it starts over.
        """
        start = hint if 0 < hint <= len(blocks) and self.pool.lookup(blocks[hint - 1]) else 0
        while start < len(blocks) and self.pool.lookup(blocks[start]) is not None:
            start += 1
        return start

    def match(self, blocks: Sequence[HashedBlock], num_tokens: int) -> PrefixMatch:
        """The usable hit of a ``num_tokens`` prompt over its ``blocks`` (``find_prefix``).

        NOTE: never the whole prompt: the last token is always computed because its logits
        are needed, so a hit covering every token is capped at ``num_tokens - 1``.

        Returns:
            PrefixMatch; ``num_pending_tokens`` counts the blocks right after the hit that a
            live sequence is computing now, its computed prefix at the first of them (the
            scheduler may wait for them: in-flight dedup).
        """
        pages = self.cached_pages(blocks)
        in_pool = len(pages)
        if self._state is not None:
            # NOTE: a hybrid model resumes only where a state checkpoint is: pages past the
            # last one are recomputed (and re-checkpointed), not shared
            pages = pages[: self._state.hit_blocks(blocks, len(pages), num_tokens)]
        num_cached = min(len(pages) * self.page_size, num_tokens - 1)
        pending = 0
        # in-flight dedup waits for blocks another sequence computes; a hybrid model can use
        # them only if its own hit reaches them and they get checkpointed (every block)
        dedup = self._state is None or (len(pages) == in_pool and self._state.slots.every_blocks == 1)
        for block in blocks[len(pages) :] if dedup else ():
            owner = self._pending.get(block.block_hash)
            if owner is None:
                break
            if pending == 0 and not self._computing_now(owner, len(pages) * self.page_size):
                break
            pending += 1
        return PrefixMatch(
            num_cached_tokens=num_cached,
            page_ids=tuple(p.page_id for p in pages),
            num_pending_tokens=pending * self.page_size,
            num_free_hit_pages=sum(1 for p in pages if p.ref_count == 0),
        )

    def _computing_now(self, owner: Hashable, start: int) -> bool:
        """Whether ``owner`` computes the block at ``start`` next: its computed prefix reached it.

        NOTE: a sequence registers every block of its prompt as pending when it is admitted,
        but a long prompt chunked behind decoding streams reaches its late blocks only after
        many steps; a request sharing one of those blocks would wait for all of them, far
        longer than computing its own few tokens would take. So a run of pending blocks
        counts as in flight only once its owner's frontier is at the run's first block."""
        computed = self._computed(owner)
        return computed is not None and computed >= start
