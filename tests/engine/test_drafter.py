"""The n-gram drafter (pure): what it proposes from a sequence's own context, and how the draft
length adapts."""

from __future__ import annotations

from prefixgate.engine.drafter import DraftState, NgramDrafter


def test_proposes_what_followed_the_latest_earlier_occurrence():
    drafter = NgramDrafter(max_draft=4, max_model_len=1000)
    state = DraftState(k=4)
    tokens = [1, 2, 3, 9, 9, 1, 2, 3, 7, 8, 5, 1, 2, 3]
    # "1 2 3" occurred twice before; the latest was followed by 7 8 5 1
    assert drafter.propose(tokens, state, limit=10) == [7, 8, 5, 1]
    assert drafter.propose(tokens, state, limit=2) == [7, 8]  # the request's remaining output
    assert drafter.propose([4, 5, 6], DraftState(k=4), limit=10) == []  # no match: no cost
    # incremental: the index grows with the sequence and a new occurrence wins
    tokens += [4, 4, 1, 2, 3]
    assert drafter.propose(tokens, state, limit=10) == [4, 4, 1, 2]
    assert NgramDrafter(4, max_model_len=len(tokens) + 2).propose(tokens, DraftState(k=4), 10) == [4]


def test_draft_length_adapts_to_acceptance():
    drafter = NgramDrafter(max_draft=5, max_model_len=1000)
    state = DraftState(k=3)
    drafter.record(state, 3, 3)
    assert state.k == 4
    drafter.record(state, 4, 1)
    assert state.k == 2  # one past the accepted run
    drafter.record(state, 2, 0)
    assert state.k == 1
    for _ in range(10):
        drafter.record(state, state.k, state.k)
    assert state.k == 5  # capped
    assert (drafter.num_drafts, drafter.num_accepted) == (13, 3 + 1 + sum(range(1, 6)) + 5 * 5)
