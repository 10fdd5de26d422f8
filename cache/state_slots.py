"""The recurrent-state layer group of a hybrid model: slots of a fixed-size state, kept by the
KV manager beside the pages (pure Python; the runner holds the tensors).

A slot holds one sequence's state of every linear layer (the conv window and the recurrent
matrix). Three uses:

* **working**: each live sequence owns one; it is the state after the sequence's first
  ``num_computed`` tokens, advanced by every step that computes some of them;
* **pending checkpoint**: taken by ``prepare_write`` for a block boundary the step crosses; the
  runner copies the state there after that row;
* **checkpoint**: once the block is computed (``commit``), the slot is registered under the
  block's chained hash, like a cached page. A prefix hit at block k needs the pages of blocks
  ``< k`` and the checkpoint of block ``k - 1``; the manager caps a hit to the last block that
  has one.

A checkpoint is content-addressed: the state after a block depends only on the tokens up to
it, which the chained hash names (tenant salt included), so it stays valid whatever happens to
the pages and is shared by every sequence (copy-on-write by construction: a restore copies it
into the sequence's working slot; nothing writes into a checkpoint).

Checkpoints are evicted least recently used first, those whose block's page is pinned or
retained last (``protected``). Working and pending slots are never evicted; admission asks
:meth:`can_start` before allocating a sequence.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Hashable, Iterable
from typing import Any, NamedTuple, Protocol

from prefixgate.cache.errors import IntegrityError, InvalidArgumentError, OutOfPagesError

ZERO_STATE = -1  # StateOps.restore: the sequence starts from the zero state


class StateOps(NamedTuple):
    """What the runner does with a chunk's state (runner.ChunkState has the same fields).

    ``slot``: the working slot; ``restore``: set it from this checkpoint slot first
    (``ZERO_STATE``: zero it; None: keep); ``saves``: ``(row, slot)``: checkpoint after the
    chunk's row ``row`` into ``slot``.
    """

    slot: int
    restore: int | None
    saves: tuple[tuple[int, int], ...]


class StateSecondTier(Protocol):
    """Where evicted checkpoints go (engine/state_tier.py: host memory)."""

    def __contains__(self, block_hash: bytes) -> bool: ...

    def spill(self, block_hash: bytes, slot: int) -> None: ...

    def take(self, block_hash: bytes) -> Any: ...

    def write(self, entry: Any, slot: int) -> None: ...

    def clear(self) -> None: ...


class StateSlots:
    """Slots of a recurrent layer group (see the module docstring).

    Args:
        num_slots: slots in the runner's state pool.
        every_blocks: checkpoint cadence during prefill: every this many blocks (1: every
            block); the last full block of what a chunk computes is always checkpointed.
    """

    def __init__(self, num_slots: int, every_blocks: int = 1) -> None:
        if num_slots < 2:
            raise InvalidArgumentError(f"state slots must be >= 2, got {num_slots}")
        if every_blocks < 1:
            raise InvalidArgumentError(f"checkpoint cadence must be >= 1 block, got {every_blocks}")
        self.num_slots = num_slots
        self.every_blocks = every_blocks
        self._free = list(range(num_slots - 1, -1, -1))
        self._working: dict[Hashable, int] = {}
        self._restore: dict[Hashable, int | None] = {}
        # checkpoint slots a scheduled restore reads, until the step ran (commit/release):
        # evicting one before the runner copied it would hand its sequence another state
        self._reading: dict[Hashable, int] = {}
        self._pending: dict[Hashable, dict[int, tuple[int, bytes]]] = {}  # seq -> block -> (slot, hash)
        self._step_saves: dict[Hashable, tuple[tuple[int, int], ...]] = {}
        self._copies: list[tuple[int, int]] = []  # forks' (parent slot, child slot), see fork()
        self._checkpoints: OrderedDict[bytes, int] = OrderedDict()  # LRU first
        self.protected: Callable[[bytes], bool] = lambda _hash: False
        # evicted checkpoints are copied here, while their slot still holds them, and come
        # back on a hit (None: evicted checkpoints are gone)
        self.tier: StateSecondTier | None = None
        self.num_saved = 0  # checkpoints registered, ever
        self.num_evicted = 0

    # ------------------------------------------------------------------ queries

    def checkpoint(self, block_hash: bytes) -> int | None:
        """The slot holding the state after the block ``block_hash``, if one is kept."""
        return self._checkpoints.get(block_hash)

    def available(self, block_hash: bytes) -> bool:
        """Whether a checkpoint of ``block_hash`` is in a slot or in the second tier."""
        return block_hash in self._checkpoints or (self.tier is not None and block_hash in self.tier)

    @property
    def num_checkpoints(self) -> int:
        return len(self._checkpoints)

    @property
    def num_working(self) -> int:
        return len(self._working)

    def can_start(self, restore_from: bytes | None = None, count: int = 1) -> bool:
        """Whether a new sequence restoring ``restore_from`` can get ``count`` working slots
        (itself and its n - 1 forks): free ones, or checkpoints to evict that no restore reads
        (nor its own)."""
        if restore_from is not None and restore_from not in self._checkpoints:
            count += 1  # the checkpoint comes back from the second tier into a slot of its own
        if len(self._free) >= count:
            return True
        busy = {self._checkpoints.get(restore_from) if restore_from is not None else None,
                *self._restore.values(), *self._reading.values()}
        evictable = sum(1 for slot in self._checkpoints.values() if slot not in busy)
        return len(self._free) + evictable >= count

    # ------------------------------------------------------------------ mutations

    def start(self, seq_id: Hashable, restore_from: bytes | None) -> int:
        """Give ``seq_id`` a working slot, to be set from the checkpoint of ``restore_from``
        (the last hit block's hash) or zeroed, before its first chunk runs."""
        if seq_id in self._working:
            raise InvalidArgumentError(f"state: sequence {seq_id!r} already has a slot")
        if restore_from is not None and restore_from not in self._checkpoints:
            self._reinstall(restore_from)
        source = self._checkpoints.get(restore_from) if restore_from is not None else None
        if source is not None:
            self._checkpoints.move_to_end(restore_from)  # a hit renews it
        slot = self._take(keep=source)
        self._working[seq_id] = slot
        self._restore[seq_id] = ZERO_STATE if source is None else source
        return slot

    def fork(self, parent_id: Hashable, child_id: Hashable) -> None:
        """``child_id`` starts from ``parent_id``'s current state: the copy is handed out by
        :meth:`take_copies` and made at once, between steps.

        NOTE: not as a restore before the child's first step: the parent runs in that step
        too, and a fault-isolation re-run of the child alone would read the parent's slot
        after the parent's own re-run had advanced it."""
        self._working[child_id] = self._take()
        self._copies.append((self._working[parent_id], self._working[child_id]))

    def take_copies(self) -> list[tuple[int, int]]:
        """The ``(source slot, destination slot)`` copies forks need now."""
        copies, self._copies = self._copies, []
        return copies

    def plan_saves(self, seq_id: Hashable, boundaries: Iterable[tuple[int, int, bytes, bool]]) -> None:
        """Checkpoint slots for the block ends this step crosses: ``(block, row, hash, evict)``
        with ``row`` the chunk row of the block's last token. A boundary whose hash has a
        checkpoint already is skipped; one without a free slot evicts the least recently used
        checkpoint only if ``evict`` (else it is skipped: checkpoints are soft).

        NOTE: only a chunk's last block, a decoded block and a divergence point may evict; the
        cadence's intermediate blocks take free slots only. Otherwise one long cold prompt
        under a tight slot budget would cycle through every slot, evicting the shared
        prefixes' checkpoints for its own middle blocks, which nothing else reads."""
        saves = []
        pending = self._pending.setdefault(seq_id, {})
        # the blocks that may evict first: a chunk's own cadence blocks must not take the free
        # slots its last block needs
        for block, row, block_hash, evict in sorted(boundaries, key=lambda b: not b[3]):
            if block_hash in self._checkpoints or block in pending:
                continue
            slot = self._take(optional=True, evict=evict)
            if slot is None:
                continue
            pending[block] = (slot, block_hash)
            saves.append((row, slot))
        self._step_saves[seq_id] = tuple(sorted(saves))

    def ops(self, seq_id: Hashable) -> StateOps:
        """The state work of ``seq_id``'s chunk this step (its restore is handed out once)."""
        restore = self._restore.pop(seq_id, None)
        if restore is not None and restore != ZERO_STATE:
            self._reading[seq_id] = restore
        return StateOps(self._working[seq_id], restore, self._step_saves.pop(seq_id, ()))

    def commit(self, seq_id: Hashable, num_full_blocks: int) -> None:
        """Blocks below ``num_full_blocks`` are computed: their pending checkpoints register."""
        self._reading.pop(seq_id, None)
        pending = self._pending.get(seq_id)
        if not pending:
            return
        for block in [b for b in pending if b < num_full_blocks]:
            slot, block_hash = pending.pop(block)
            if block_hash in self._checkpoints:  # another sequence saved the same block first
                self._free.append(slot)
                continue
            self._checkpoints[block_hash] = slot
            self.num_saved += 1

    def release(self, seq_id: Hashable) -> None:
        """``seq_id`` ended: its working slot and uncommitted checkpoints are free again."""
        slot = self._working.pop(seq_id, None)
        if slot is not None:
            self._free.append(slot)
        self._restore.pop(seq_id, None)
        self._reading.pop(seq_id, None)
        self._step_saves.pop(seq_id, None)
        for pending_slot, _hash in self._pending.pop(seq_id, {}).values():
            self._free.append(pending_slot)

    def clear_checkpoints(self) -> int:
        """Drop every checkpoint (cache reset); returns how many."""
        dropped = len(self._checkpoints)
        self._free.extend(self._checkpoints.values())
        self._checkpoints.clear()
        if self.tier is not None:
            self.tier.clear()
        return dropped

    def check(self, live: Iterable[Hashable]) -> None:
        """Slots conserved, each live sequence owns one working slot, no slot used twice."""
        pending = [slot for by_block in self._pending.values() for slot, _ in by_block.values()]
        used = [*self._free, *self._working.values(), *self._checkpoints.values(), *pending]
        if sorted(used) != list(range(self.num_slots)):
            raise IntegrityError("state slots not conserved: free + working + checkpoints + "
                                 "pending != all, or one slot in two places")
        if set(self._working) != set(live):
            raise IntegrityError("state: working slots do not match the live sequences")

    # ------------------------------------------------------------------ internals

    def _reinstall(self, block_hash: bytes) -> None:
        """Bring a checkpoint back from the second tier into a slot (LRU end)."""
        if self.tier is None or block_hash not in self.tier:
            raise InvalidArgumentError("state: no checkpoint of the hit block in the slots or the tier")
        entry = self.tier.take(block_hash)  # first: evictions below may spill into the tier
        slot = self._take()
        self.tier.write(entry, slot)
        self._checkpoints[block_hash] = slot

    def _take(self, *, keep: int | None = None, optional: bool = False,
              evict: bool = True) -> int | None:
        """A free slot, else (``evict``) the least recently used checkpoint's (protected ones
        last); never ``keep`` nor one a scheduled restore reads."""
        if self._free:
            return self._free.pop()
        if not evict:
            return None
        busy = {keep, *self._restore.values(), *self._reading.values()}
        for protected_pass in (False, True):
            for block_hash, slot in self._checkpoints.items():
                if slot not in busy and self.protected(block_hash) == protected_pass:
                    del self._checkpoints[block_hash]
                    self.num_evicted += 1
                    if self.tier is not None:  # NOTE: the slot still holds it: copy it out now
                        self.tier.spill(block_hash, slot)
                    return slot
        if optional:
            return None
        raise OutOfPagesError(1, 0)


__all__ = ["ZERO_STATE", "StateOps", "StateSlots"]
