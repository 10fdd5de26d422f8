"""cache/state_slots.py and the KV manager's recurrent-state group: exact slots, LRU order,
the hit cap at the last checkpoint, and conservation under random operations."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from prefixgate.cache import KVCacheManager, StateSlots, TokenSequence
from prefixgate.cache.errors import OutOfPagesError
from prefixgate.cache.state_slots import ZERO_STATE

PS = 4


def test_slots_working_checkpoint_lru_and_reads() -> None:
    slots = StateSlots(3)
    assert slots.start("a", None) == 0
    assert slots.ops("a") == (0, ZERO_STATE, ())
    slots.plan_saves("a", [(0, 3, b"h0", False), (1, 7, b"h1", True)])
    # the block that may evict (the chunk's last) takes a slot first; saves come in row order
    assert slots.ops("a").saves == ((3, 2), (7, 1))
    slots.commit("a", 1)  # only block 0 is computed
    assert slots.checkpoint(b"h0") == 2 and slots.checkpoint(b"h1") is None
    slots.commit("a", 2)
    slots.release("a")
    assert slots.num_checkpoints == 2 and slots.can_start()
    # b restores h1: h1 is renewed, h0 (least recently used) is evicted for b's working slot
    assert slots.start("b", b"h1") == 0  # the free slot first
    assert slots.ops("b") == (0, 1, ())
    assert slots.start("c", None) == 2 and slots.checkpoint(b"h0") is None
    # h1 is read by b's scheduled restore until b's step commits: never evicted before that
    with pytest.raises(OutOfPagesError):
        slots.start("d", None)
    slots.commit("b", 0)
    assert slots.start("d", None) == 1 and slots.num_evicted == 2
    slots.check(["b", "c", "d"])


def test_protected_checkpoints_are_evicted_last() -> None:
    slots = StateSlots(3)
    slots.protected = lambda h: h == b"pinned"
    for name, block_hash in (("a", b"pinned"), ("b", b"plain")):
        slots.start(name, None)
        slots.plan_saves(name, [(0, 3, block_hash, True)])
        slots.ops(name)
        slots.commit(name, 1)
        slots.release(name)
    slots.start("c", None)  # free slot
    slots.start("d", None)  # evicts the plain one although the pinned one is older
    assert slots.checkpoint(b"pinned") is not None and slots.checkpoint(b"plain") is None


def _manager(num_slots: int = 8, every: int = 1) -> KVCacheManager:
    return KVCacheManager(32, PS, watermark=0.0, state_slots=StateSlots(num_slots, every))


def _compute(cache: KVCacheManager, seq: TokenSequence, n: int):
    cache.prepare_write(seq.seq_id, n)
    ops = cache.state_ops(seq.seq_id)
    cache.commit_computed(seq.seq_id, n)
    return ops


def test_manager_caps_hits_to_checkpoints_and_saves_where_prompts_diverge() -> None:
    cache = _manager(every=4)
    first = TokenSequence("a", list(range(20)))
    cache.allocate(first)
    ops = _compute(cache, first, 20)
    # cadence 4 blocks -> block 3; the chunk's last full block is 4 as well
    assert [row for row, _ in ops.saves] == [15, 19]
    cache.free("a")
    second = TokenSequence("b", list(range(10)) + [99] * 6)
    alloc = cache.allocate(second)
    # pages hit blocks 0-1 (tokens 0..7) but no checkpoint there: a hybrid resumes at 0
    assert alloc.num_cached_tokens == 0
    ops = _compute(cache, second, 16)
    # block 1 is where the prompt leaves the pool: checkpointed for the next one
    assert [row for row, _ in ops.saves][:1] == [7]
    cache.free("b")
    third = TokenSequence("c", list(range(10)) + [42] * 6)
    assert cache.allocate(third).num_cached_tokens == 8
    cache.check_integrity()


@settings(max_examples=40, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 3), st.integers(1, 30)), min_size=1, max_size=25),
       st.integers(2, 6), st.integers(1, 3))
def test_random_operations_conserve_slots(ops, num_slots, every) -> None:
    cache = _manager(num_slots, every)
    live: list[TokenSequence] = []
    for step, (kind, length) in enumerate(ops):
        seq = TokenSequence(step, [t % 7 for t in range(length)] + [step])
        blocks = cache.block_hashes(seq)
        if kind <= 1 and cache.can_start_sequence(blocks, cache.find_prefix(seq.token_ids, blocks=blocks)):
            cache.allocate(seq)
            live.append(seq)
        elif kind == 2 and live:
            seq = live[step % len(live)]
            remaining = len(seq.token_ids) - seq.num_computed
            if remaining and cache.pages_needed(seq.seq_id, remaining) <= cache.num_free_pages:
                _compute(cache, seq, remaining)
        elif live:
            cache.free(live.pop(0).seq_id)
        cache.check_integrity()
    for seq in live:
        cache.free(seq.seq_id)
    cache.check_integrity()
    assert cache.state.num_working == 0


def test_cadence_checkpoints_never_evict_only_chunk_ends_do() -> None:
    slots = StateSlots(4)
    slots.start("old", None)
    slots.plan_saves("old", [(0, 3, b"shared", True)])
    slots.ops("old")
    slots.commit("old", 1)
    slots.release("old")  # 3 free slots, 1 checkpoint
    slots.start("long", None)  # takes a free slot: 2 free left
    # its last block takes a free slot first, the middle blocks the rest, then stop: the
    # shared prefix's checkpoint survives
    slots.plan_saves("long", [(b, 4 * b + 3, b"m%d" % b, False) for b in range(5)]
                     + [(5, 23, b"last", True)])
    assert [row for row, _ in slots.ops("long").saves] == [3, 23]
    slots.commit("long", 6)
    assert all(slots.checkpoint(h) is not None for h in (b"shared", b"last", b"m0"))
    # with no free slot left, only a block that may evict takes one (the LRU checkpoint's)
    slots.plan_saves("long", [(6, 27, b"m6", False), (7, 31, b"last2", True)])
    assert [row for row, _ in slots.ops("long").saves] == [31]
    assert slots.checkpoint(b"shared") is None
    slots.check(["long"])


class _Tier(dict):
    """A stand-in second tier: slot numbers instead of tensors."""

    def spill(self, block_hash: bytes, slot: int) -> None:
        self[block_hash] = slot

    def take(self, block_hash: bytes) -> int:
        return self.pop(block_hash)

    def write(self, entry: int, slot: int) -> None:
        self.written = (entry, slot)


def test_evicted_checkpoints_spill_to_the_tier_and_come_back_for_a_hit() -> None:
    slots = StateSlots(2)
    slots.tier = tier = _Tier()
    slots.start("a", None)
    slots.plan_saves("a", [(0, 3, b"h0", True)])
    slots.ops("a")
    slots.commit("a", 1)
    slots.release("a")
    slots.start("b", None)  # free slot
    slots.start("c", None)  # evicts h0: copied out while its slot still holds it
    assert tier == {b"h0": 1} and not slots.checkpoint(b"h0") and slots.available(b"h0")
    slots.release("b")
    slots.release("c")
    # a hit on h0 needs its working slot and one to bring the checkpoint back into
    assert slots.can_start(b"h0") and not slots.can_start(b"h0", count=2)
    working = slots.start("d", b"h0")
    restore = slots.ops("d").restore
    assert tier.written == (1, restore) and slots.checkpoint(b"h0") == restore != working
    assert b"h0" not in tier
    slots.check(["d"])
