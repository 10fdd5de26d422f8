"""The recurrent-state layer group as the KV manager drives it (a hybrid model's linear-
attention layers: a fixed-size state per sequence instead of per-token K/V).

Beside the paged groups (full attention, sliding window: K/V in the pool's pages), this group's
cache is the state slots (cache/state_slots.py): a working slot per live sequence and state
checkpoints keyed by the chained block hash. A prefix hit is usable up to its last checkpoint;
a prefill plans the checkpoints its chunk crosses.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence

from prefixgate.cache.block_pool import BlockPool
from prefixgate.cache.hashing import BlockHash, HashedBlock
from prefixgate.cache.sequence import CacheSequence
from prefixgate.cache.state_slots import StateSlots


class StateGroup:
    """The manager's recurrent-state group.

    Args:
        slots: the state slots.
        pool: the block pool (pinned and retained prefixes keep their checkpoints longest).
    """

    def __init__(self, slots: StateSlots, pool: BlockPool) -> None:
        self.slots = slots
        self.pool = pool
        self.page_size = pool.page_size
        self._diverged: dict[Hashable, int] = {}  # seq -> last pool-hit block past its state hit
        slots.protected = self._protects_checkpoint

    def _protects_checkpoint(self, block_hash: BlockHash) -> bool:
        page = self.pool.cached.get(block_hash)
        return page is not None and (page.pinned or page.retain_until > self.pool.clock())

    def hit_blocks(self, blocks: Sequence[HashedBlock], num_pages: int, num_tokens: int) -> int:
        """Of ``num_pages`` leading pool-hit blocks, how many a hybrid model can use: up to the
        last one with a state checkpoint, ending at or before the last prompt token."""
        usable = min(num_pages, (num_tokens - 1) // self.page_size)
        while usable > 0 and not self.slots.available(blocks[usable - 1].block_hash):
            usable -= 1
        return usable

    def start(self, seq_id: Hashable, blocks: Sequence[HashedBlock], hit_blocks: int, in_pool: int) -> None:
        """The new sequence's working slot, restored from its hit's checkpoint; and the block
        where its prefix leaves the pool (``in_pool`` blocks cached; checkpointed on the way:
        the next request with the same prefix then hits it whole)."""
        self.slots.start(seq_id, blocks[hit_blocks - 1].block_hash if hit_blocks else None)
        if in_pool > hit_blocks:
            self._diverged[seq_id] = in_pool - 1

    def can_start(self, blocks: Sequence[HashedBlock], hit_blocks: int, count: int) -> bool:
        """Whether ``count`` new sequences (one and its forks) whose hit is the leading
        ``hit_blocks`` of ``blocks`` can get their working slots."""
        return self.slots.can_start(blocks[hit_blocks - 1].block_hash if hit_blocks else None, count)

    def plan_saves(self, seq: CacheSequence, num_new_tokens: int,
                   hashes: Sequence[HashedBlock] | None) -> None:
        """Checkpoint the block ends ``num_new_tokens`` from ``num_computed`` cross, at the
        cadence, at the last full block they reach, and where the prefix left the pool
        (``hashes``: the sequence's block hashes; None = caching off, no checkpoints)."""
        if hashes is None:
            self.slots.plan_saves(seq.seq_id, ())
            return
        ps, start = self.page_size, seq.num_computed
        end = start + num_new_tokens
        last_block = end // ps - 1
        diverged = self._diverged.get(seq.seq_id)
        boundaries = []
        for block in range(start // ps, last_block + 1):
            block_end = (block + 1) * ps
            if block_end <= start:
                continue
            essential = block in (last_block, diverged)
            if essential or (block + 1) % self.slots.every_blocks == 0:
                boundaries.append((block, block_end - 1 - start, hashes[block].block_hash, essential))
        self.slots.plan_saves(seq.seq_id, boundaries)

    def release(self, seq_id: Hashable) -> None:
        self.slots.release(seq_id)
        self._diverged.pop(seq_id, None)
