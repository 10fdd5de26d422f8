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
    assert slots.ops("a").saves == ((3, 1), (7, 2))
    slots.commit("a", 1)  # only block 0 is computed
    assert slots.checkpoint(b"h0") == 1 and slots.checkpoint(b"h1") is None
    slots.commit("a", 2)
    slots.release("a")
    assert slots.num_checkpoints == 2 and slots.can_start()
    # b restores h1: h1 is renewed, h0 (least recently used) is evicted for b's working slot
    assert slots.start("b", b"h1") == 0  # the free slot first
    assert slots.ops("b") == (0, 2, ())
    assert slots.start("c", None) == 1 and slots.checkpoint(b"h0") is None
    # h1 is read by b's scheduled restore until b's step commits: never evicted before that
    with pytest.raises(OutOfPagesError):
        slots.start("d", None)
    slots.commit("b", 0)
    assert slots.start("d", None) == 2 and slots.num_evicted == 2
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
    # a long prompt's middle blocks take the free slots, then stop; its last block evicts
    slots.plan_saves("long", [(b, 4 * b + 3, b"m%d" % b, False) for b in range(5)]
                     + [(5, 23, b"last", True)])
    assert len(slots.ops("long").saves) == 3
    assert slots.checkpoint(b"shared") is None  # the last block evicted the LRU one
    slots.commit("long", 6)
    assert slots.checkpoint(b"last") is not None and slots.checkpoint(b"m0") is not None
    slots.check(["long"])
