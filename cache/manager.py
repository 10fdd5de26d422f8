"""KVCacheManager: block tables, verified prefix hits, on-demand growth, fork + copy-on-write.

The scheduler drives it once per step, per sequence:

    allocate(seq)                    prefix hit: leading pages shared, num_computed = hit
    prepare_write(seq_id, n)         pages for the next n positions exist and are private
                                     (returns copy-on-write (src, dst) pairs for the runner)
    ... the runner writes K/V of those n tokens ...
    commit_computed(seq_id, n)       full blocks become hittable (BlockStored events)
    ... the scheduler appends the sampled token to seq.token_ids ...
    free(seq_id)                     every page released, tail first

``seq`` is the engine's sequence record, read through ``cache.sequence.CacheSequence``: it owns
the token ids and the block-hash chain; the manager keeps the block table.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from typing import NamedTuple

from prefixgate.cache.block_pool import BlockPool
from prefixgate.cache.copy_on_write import CopyOnWrite
from prefixgate.cache.errors import (
    DuplicateSequenceError,
    InvalidArgumentError,
    OutOfPagesError,
    UnknownSequenceError,
)
from prefixgate.cache.events import EventSink, PrefixQueried
from prefixgate.cache.hashing import BlockHasher, HashedBlock, HashFn
from prefixgate.cache.integrity import check_manager
from prefixgate.cache.kept_prefixes import KeptPrefixes
from prefixgate.cache.prefix_lookup import NO_MATCH, PrefixLookup, PrefixMatch
from prefixgate.cache.sequence import CacheSequence, SequenceBlocks
from prefixgate.cache.state_group import StateGroup
from prefixgate.cache.state_slots import StateOps, StateSecondTier, StateSlots
from prefixgate.cache.stats import CacheStats, CacheStatsCollector, snapshot
from prefixgate.cache.tier_pages import TierPages

__all__ = ["Allocation", "KVCacheManager", "PrefixMatch"]


class Allocation(NamedTuple):
    num_cached_tokens: int
    block_table: tuple[int, ...]

class KVCacheManager:
    """Paged KV cache manager with chained-hash prefix sharing (pure Python, no torch).

    Args:
        num_pages: physical pages in the pool.
        page_size: tokens per page.
        enable_caching: off = no prefix hits (for the uncached baseline).
        watermark: admission keeps at least this fraction of pages free.
        hash_seed: fixed seed for block hashes (replicas must agree).
        hash_fn: override of the digest (tests force collisions).
        event_sink: receives BlockStored / BlockRemoved.
        state_slots: a hybrid model's recurrent-state group (cache/state_slots.py): a hit
            then needs the state checkpoint of its last block, and every sequence owns a
            working slot. None: an attention-only model.
    """

    def __init__(
        self,
        num_pages: int,
        page_size: int,
        *,
        enable_caching: bool = True,
        watermark: float = 0.10,
        hash_seed: int = 0,
        hash_fn: HashFn | None = None,
        event_sink: EventSink | None = None,
        state_slots: StateSlots | None = None,
    ):
        if not 0 <= watermark < 1:
            raise InvalidArgumentError(f"watermark must be in [0, 1), got {watermark}")
        # counters live in the collector, fed by the manager's and the pool's events
        self.collector = CacheStatsCollector()
        self.pool = BlockPool(num_pages, page_size, enable_caching=enable_caching,
                              event_sink=event_sink, stats_sink=self.collector.record)
        self.page_size = page_size
        self.num_pages = num_pages
        self.enable_caching = enable_caching
        self.watermark_pages = int(watermark * num_pages)
        self.hasher = BlockHasher(page_size, hash_seed, hash_fn)
        self._seqs: dict[Hashable, SequenceBlocks] = {}
        self.tier_pages = TierPages(self.pool, self.watermark_pages, self._holders)
        self.state = state_slots  # the recurrent-state group's slots (tests and stats read them)
        self._state = StateGroup(state_slots, self.pool) if state_slots is not None else None
        self.lookup = PrefixLookup(self.pool, self.hasher, self._state, self._computed)
        self.kept = KeptPrefixes(self.pool, self.lookup.cached_prefix_pages)
        self.cow = CopyOnWrite(self.pool, self.collector.record)
        self.retention = self.kept.retention  # the retention policy (stats read its budgets)

    # ------------------------------------------------------------------ queries

    @property
    def num_free_pages(self) -> int:
        return self.pool.num_free_pages

    def __contains__(self, seq_id: Hashable) -> bool:
        return seq_id in self._seqs

    def can_allocate(self, num_pages: int) -> bool:
        """Whether taking ``num_pages`` more pages keeps the free-page watermark."""
        return self.pool.num_free_pages - num_pages >= self.watermark_pages

    def find_prefix(
        self, token_ids: Sequence[int], extra_keys: bytes = b"", *, blocks: list[HashedBlock] | None = None
    ) -> PrefixMatch:
        """Longest verified full-block prefix of ``token_ids`` held in cached pages, never the
        whole prompt, and the blocks after it being computed now (``PrefixLookup.match``).

        Args:
            blocks: ``hasher.hash_blocks(token_ids, extra_keys)`` when the caller already has it.
        """
        if not token_ids:
            raise InvalidArgumentError("empty token list")
        if not self.enable_caching:
            return NO_MATCH
        if blocks is None:
            blocks = self.hasher.hash_blocks(token_ids, extra_keys)
        return self.lookup.match(blocks, len(token_ids))

    def pages_needed_for_prompt(self, num_tokens: int, match: PrefixMatch) -> int:
        """Free pages that allocating and fully computing a prompt would consume."""
        return self.cow.pages_for_prompt(num_tokens, match)

    def pages_needed(self, seq_id: Hashable, num_new_tokens: int, num_lookahead: int = 0) -> int:
        """New pages (incl. copy-on-write copies) that ``prepare_write(seq_id, n, lookahead)``
        would take."""
        seq = self._get(seq_id, "pages_needed")
        cow_blocks, num_new_pages = self.cow.plan(seq, num_new_tokens + num_lookahead)
        return len(cow_blocks) + num_new_pages

    def block_table(self, seq_id: Hashable) -> list[int]:
        """The sequence's block table (a copy)."""
        return list(self._get(seq_id, "block_table").block_table)

    def num_computed_tokens(self, seq_id: Hashable) -> int:
        return self._get(seq_id, "num_computed_tokens").seq.num_computed

    def num_tokens(self, seq_id: Hashable) -> int:
        return len(self._get(seq_id, "num_tokens").seq.token_ids)

    def sequence(self, seq_id: Hashable) -> CacheSequence:
        """The record of live sequence ``seq_id`` (as given to :meth:`allocate` / :meth:`fork`)."""
        return self._get(seq_id, "sequence").seq

    def block_hashes(self, seq: CacheSequence) -> list[HashedBlock]:
        """``seq``'s chain of full-block hashes, extended to its current tokens.

        NOTE: the one place a sequence's chain grows, and lazily: a request deferred by dedup
        or by the watermark is looked up again every step, and a decode adds a block only every
        ``page_size`` tokens; hashing once per block keeps both cheap.

        Args:
            seq: any sequence record, live here or not (a waiting request's).
        Returns:
            ``seq.block_hashes`` itself, extended in place.
        """
        return self.hasher.extend(seq.block_hashes, seq.token_ids, seq.extra_keys)

    def ref_count(self, page_id: int) -> int:
        return self.pool.pages[page_id].ref_count

    # ------------------------------------------------------------------ mutations

    def allocate(self, seq: CacheSequence, *, count_query: bool = True) -> Allocation:
        """Start a sequence: share the longest verified cached prefix of ``seq.token_ids``.

        No page is allocated for the uncached part yet; :meth:`prepare_write` does that as
        chunks are scheduled (memory follows what is actually computed).

        Args:
            seq: the record (new, unique ``seq_id``); its tokens are the prompt (or prompt +
                generated tokens when resuming a preempted one). Its chain is extended here;
                ``seq.num_computed`` becomes the hit.
            count_query: False when re-admitting a preempted sequence (already counted).
        Returns:
            Allocation(num_cached_tokens, block_table).
        """
        seq_id, token_ids = seq.seq_id, seq.token_ids
        if seq_id in self._seqs:
            raise DuplicateSequenceError(f"allocate: sequence id {seq_id!r} is already live")
        if not token_ids:
            raise InvalidArgumentError(f"allocate({seq_id!r}): empty prompt")
        if len(seq.block_hashes) > len(token_ids) // self.page_size:
            raise InvalidArgumentError(f"allocate({seq_id!r}): {len(seq.block_hashes)} block "
                                       f"hashes for {len(token_ids)} tokens")
        blocks = self.block_hashes(seq)
        match = self.lookup.match(blocks, len(token_ids)) if self.enable_caching else NO_MATCH
        pages = [self.pool.pages[i] for i in match.page_ids]
        # counted before touch() takes the pages out of the retained set
        retention_hit = self.kept.retention_hit_tokens(pages, match.num_cached_tokens) if count_query else 0
        self.pool.touch(pages)
        entry = SequenceBlocks(seq, [p.page_id for p in pages], match.num_cached_tokens // self.page_size)
        seq.num_computed = match.num_cached_tokens
        self._seqs[seq_id] = entry
        if self._state is not None:
            in_pool = self.count_cached_blocks(blocks, len(pages)) if self.enable_caching else 0
            self._state.start(seq.seq_id, blocks, len(pages), in_pool)
        if self.enable_caching:
            self.lookup.mark_pending(blocks[len(pages) :], seq_id)
        if count_query:
            self.collector.record(PrefixQueried(seq.tenant, seq.agent, len(token_ids),
                                                match.num_cached_tokens, retention_hit))
        return Allocation(match.num_cached_tokens, tuple(entry.block_table))

    def prepare_write(self, seq_id: Hashable, num_new_tokens: int,
                      num_lookahead: int = 0) -> list[tuple[int, int]]:
        """Make the pages for positions ``[num_computed, num_computed + n + lookahead)`` exist
        and private. ``num_lookahead`` positions past the known tokens are for speculative
        draft tokens: written by the verify forward, committed only once accepted.

        Allocates a page only when a block starts (on-demand growth). A page that is shared
        (refcount > 1) or registered in the cache is copied first.

        NOTE: invariant 3 lives here: no write ever lands in a page with refcount > 1, nor in
        a cached page (its content must stay what its hash says).

        Returns:
            Copy-on-write ``(src_page, dst_page)`` pairs; the runner must copy them before the
            forward pass that writes these positions.
        Raises:
            OutOfPagesError: not enough free pages (nothing changed).
        """
        entry = self._get(seq_id, "prepare_write")
        seq = entry.seq
        if num_new_tokens < 1:
            raise InvalidArgumentError(f"prepare_write({seq_id!r}): num_new_tokens must be >= 1")
        if seq.num_computed + num_new_tokens > len(seq.token_ids):
            raise InvalidArgumentError(
                f"prepare_write({seq_id!r}): {num_new_tokens} new tokens from position "
                f"{seq.num_computed} exceed the {len(seq.token_ids)} known tokens"
            )
        if num_lookahead < 0:
            raise InvalidArgumentError(f"prepare_write({seq_id!r}): num_lookahead must be >= 0")
        cow_blocks, num_new_pages = self.cow.plan(entry, num_new_tokens + num_lookahead)
        needed = len(cow_blocks) + num_new_pages
        if needed > self.pool.num_free_pages:
            raise OutOfPagesError(needed, self.pool.num_free_pages)
        pairs = self.cow.make_private(entry, cow_blocks, num_new_pages)
        if self._state is not None:
            self._state.plan_saves(seq, num_new_tokens, self.block_hashes(seq) if self.enable_caching else None)
        return pairs

    def commit_computed(self, seq_id: Hashable, num_new_tokens: int) -> None:
        """Record that the K/V of the next ``n`` positions is written (``seq.num_computed``
        advances by ``n``); full blocks get cached."""
        entry = self._get(seq_id, "commit_computed")
        seq = entry.seq
        end = seq.num_computed + num_new_tokens
        if num_new_tokens < 1 or end > len(entry.block_table) * self.page_size or end > len(seq.token_ids):
            raise InvalidArgumentError(
                f"commit_computed({seq_id!r}, {num_new_tokens}): positions up to {end} are not "
                f"prepared ({len(entry.block_table)} pages, {len(seq.token_ids)} tokens)"
            )
        seq.num_computed = end
        full = end // self.page_size
        if full > entry.num_registered:
            hashes = self.block_hashes(seq)
            for block_index in range(entry.num_registered, full):
                block = hashes[block_index]
                self.pool.register(self.pool.pages[entry.block_table[block_index]], block)
            self.lookup.drop_pending(hashes[entry.num_registered : full], seq_id)
            entry.num_registered = full
        if self.state is not None:
            self.state.commit(seq_id, full)

    def fork(self, parent_id: Hashable, child: CacheSequence) -> None:
        """Start ``child`` sharing every page of ``parent_id`` (partial tail included).

        The first write into a shared page by either side copies it (see prepare_write).

        Args:
            parent_id: a live sequence.
            child: a new record holding the parent's tokens and extra keys; it gets the
                parent's hash chain and computed count.
        """
        parent = self._get(parent_id, "fork")
        if child.seq_id in self._seqs:
            raise DuplicateSequenceError(f"fork: sequence id {child.seq_id!r} is already live")
        if len(child.token_ids) != len(parent.seq.token_ids) or child.extra_keys != parent.seq.extra_keys:
            raise InvalidArgumentError(f"fork({parent_id!r}, {child.seq_id!r}): the child must "
                                       "start with the parent's tokens and extra keys")
        self._seqs[child.seq_id] = self.cow.share(parent, child)
        if self.state is not None:
            self.state.fork(parent_id, child.seq_id)

    def free(self, seq_id: Hashable) -> None:
        """Release every page of the sequence, tail first (so tails are evicted before heads)."""
        entry = self._seqs.pop(seq_id, None)
        if entry is None:
            raise UnknownSequenceError(seq_id, "free")
        self.pool.release(self.pool.pages[i] for i in reversed(entry.block_table))
        self.lookup.drop_pending(entry.seq.block_hashes[entry.num_registered :], seq_id)
        if self._state is not None:
            self._state.release(seq_id)

    # ------------------------------------------------------------------ kept prefixes
    # (cache/kept_prefixes.py, ``kept``: pins, retention, holds)

    def pin(self, token_ids: Sequence[int], extra_keys: bytes = b"") -> int:
        """Pin the cached full blocks of ``token_ids``'s prefix; returns how many pages are pinned.

        Only blocks already cached are pinned: compute the prompt first to pin all of it.
        """
        return self.kept.pin(token_ids, extra_keys)

    def unpin(self, token_ids: Sequence[int], extra_keys: bytes = b"") -> int:
        """Unpin the cached full blocks of ``token_ids``'s prefix; returns how many were pinned."""
        return self.kept.unpin(token_ids, extra_keys)

    def retain(self, token_ids: Sequence[int], extra_keys: bytes, ttl_s: float,
               max_pages: int | None = None, *, tenant: str = "default",
               max_tenant_pages: int | None = None) -> int:
        """Retain the cached full blocks of ``token_ids``'s prefix for ``ttl_s`` seconds within
        the pool's budget ``max_pages`` and ``tenant``'s share ``max_tenant_pages``; how many
        pages are retained now. The contract: ``KeptPrefixes.retain`` (cache/kept_prefixes.py)."""
        return self.kept.retain(token_ids, extra_keys, ttl_s, tenant, max_pages, max_tenant_pages)

    def num_retained_pages(self, tenant: str | None = None) -> int:
        """Pages under retention: free retained ones plus referenced ones with a deadline.

        Args:
            tenant: count only the pages whose retention ``tenant``'s budget pays for.
        """
        return self.kept.num_retained(tenant)

    def num_pinned_prefix_pages(self, token_ids: Sequence[int], extra_keys: bytes = b"") -> int:
        """How many leading full blocks of ``token_ids`` are cached and pinned right now."""
        return self.kept.num_pinned(token_ids, extra_keys)

    def reset_cache(self) -> int:
        """Drop every unreferenced cached page's hash (pinned and in-use pages stay) and every
        state checkpoint."""
        if self.state is not None:
            self.state.clear_checkpoints()
        return self.pool.reset()

    # ------------------------------------------------------------------ recurrent state

    def can_start_sequence(self, blocks: Sequence[HashedBlock], match: PrefixMatch,
                           count: int = 1) -> bool:
        """Whether a new sequence with this prefix ``match`` (over its ``blocks``) can get its
        working state slot, ``count`` of them with its forks (n > 1); always without a state
        group."""
        return self._state is None or self._state.can_start(blocks, len(match.page_ids), count)

    def attach_state_tier(self, tier: StateSecondTier) -> None:
        """Evicted state checkpoints go to ``tier`` and come back from it on a hit."""
        if self.state is None:
            raise InvalidArgumentError("attach_state_tier: this manager has no state group")
        self.state.tier = tier

    def take_state_copies(self) -> list[tuple[int, int]]:
        """State slot copies ``(src, dst)`` the runner must make now (forks); [] without a
        state group."""
        return [] if self.state is None else self.state.take_copies()

    def state_ops(self, seq_id: Hashable) -> StateOps | None:
        """The state work of ``seq_id``'s chunk this step (None without a state group)."""
        return None if self.state is None else self.state.ops(seq_id)

    # ------------------------------------------------------------------ waiting requests

    def hold_prefix(self, key: Hashable, blocks: Sequence[HashedBlock]) -> None:
        """A waiting request ``key`` keeps its hit until :meth:`release_hold` (soft; the
        contract: ``KeptPrefixes.hold``)."""
        if self.enable_caching:
            self.kept.hold(key, blocks)

    def release_hold(self, key: Hashable) -> None:
        """End ``key``'s :meth:`hold_prefix` (admitted, aborted or failed); no-op without one."""
        self.kept.release(key)

    def release_all_holds(self) -> None:
        """End every hold (recovery after a failed step: no request waits any more)."""
        self.kept.release_all()

    def sequence_ids(self) -> list[Hashable]:
        """The live sequences' ids, in allocation order."""
        return list(self._seqs)

    def count_cached_blocks(self, blocks: Sequence[HashedBlock], hint: int = 0) -> int:
        """Leading ``blocks`` cached in the pool (verified), for ordering waiting requests;
        ``hint``: a previous count for the same chain (``PrefixLookup.count_cached``)."""
        return self.lookup.count_cached(blocks, hint) if self.enable_caching else 0

    # ------------------------------------------------------------------ second tier
    # (cache/tier_pages.py, ``tier_pages``: evicted pages recorded for the connector, which
    # drives it, and loaded blocks installed; these four for the cache's own tests)

    def capture_evictions(self) -> None:
        """Start recording evicted cached pages for :meth:`take_evicted`."""
        self.tier_pages.capture()

    def take_evicted(self) -> list[tuple[int, HashedBlock]]:
        return self.tier_pages.take_evicted()

    def loads_written(self) -> None:
        self.tier_pages.loads_written()

    def install_blocks(self, blocks: Sequence[HashedBlock], max_pages: int,
                       keep: Sequence[int] = ()) -> list[int]:
        return self.tier_pages.install(blocks, max_pages, keep)

    # ------------------------------------------------------------------ stats

    def stats(self, top_k: int = 5) -> CacheStats:
        """An immutable snapshot of pool state (read now) and the collector's counters.

        Args:
            top_k: shared prefixes kept per tenant (``CacheStats.top_prefixes``).
        """
        return snapshot(self.pool, self._seqs.values(), self.retention, self.collector, top_k)

    # ------------------------------------------------------------------ integrity

    def check_integrity(self) -> None:
        """Verify every invariant of docs/design.md; raises IntegrityError naming the broken one
        (cache/integrity.py)."""
        check_manager(self)

    # ------------------------------------------------------------------ internals

    def _computed(self, seq_id: Hashable) -> int | None:
        """A live sequence's computed prefix (tokens); None when it is not live."""
        entry = self._seqs.get(seq_id)
        return None if entry is None else entry.seq.num_computed

    def _holders(self, page_ids: set[int]) -> set[Hashable]:
        """The live sequences whose block tables hold any of ``page_ids``."""
        return {seq_id for seq_id, e in self._seqs.items() if page_ids.intersection(e.block_table)}

    def _get(self, seq_id: Hashable, operation: str) -> SequenceBlocks:
        entry = self._seqs.get(seq_id)
        if entry is None:
            raise UnknownSequenceError(seq_id, operation)
        return entry
