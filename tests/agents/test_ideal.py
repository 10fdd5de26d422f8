"""Ideal hit-rate math on hand-built token sequences."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from prefixgate.agents.ideal import PrefixIndex, SentPrompt, common_prefix, ideal_hits


def brute_force(sequences: list[list[int]]) -> list[int]:
    return [max((common_prefix(s, earlier) for earlier in sequences[:i]), default=0)
            for i, s in enumerate(sequences)]


def test_common_prefix():
    assert common_prefix([1, 2, 3], [1, 2, 4]) == 2
    assert common_prefix([1, 2], [1, 2, 3]) == 2
    assert common_prefix([], [1]) == 0
    assert common_prefix([5], [6]) == 0


def test_index_across_chunk_boundaries():
    base = list(range(100))  # 3 full 32-token chunks + 4 tokens
    index = PrefixIndex()
    assert index.longest_prefix(base) == 0
    index.add(base)
    assert index.longest_prefix(base) == 100
    assert index.longest_prefix(base[:64]) == 64
    assert index.longest_prefix(base[:70] + [-1] * 50) == 70
    assert index.longest_prefix(base[:31] + [-1]) == 31
    assert index.longest_prefix(base + [7, 7]) == 100
    assert index.longest_prefix([-1] + base) == 0
    index.add(base[:40] + [500, 501])
    assert index.longest_prefix(base[:40] + [500, 502]) == 41


@settings(max_examples=200, deadline=None)
@given(st.lists(st.lists(st.integers(0, 2), min_size=0, max_size=80), min_size=1, max_size=12))
def test_index_matches_brute_force(sequences):
    # A 3-letter alphabet makes long shared prefixes (and chunk-boundary cases) common.
    index = PrefixIndex()
    found = []
    for sequence in sequences:
        found.append(index.longest_prefix(sequence))
        index.add(sequence)
    assert found == brute_force(sequences)


def test_hand_built_swarm():
    system = list(range(1000, 1040))  # a 40-token shared system prompt
    a0 = system + [1, 2, 3, 4, 5]  # agent a, turn 0
    b0 = system + [9, 9, 9]  # agent b, turn 0
    # agent a, turn 1: its turn-0 prompt + 3 generated tokens (reappearing) + a follow-up
    a1 = a0 + [70, 71, 72] + [80, 81, 82, 83]
    hits = ideal_hits([SentPrompt(a0, 3, None), SentPrompt(b0, 2, None),
                       SentPrompt(a1, 2, 0)], page_size=16)
    # 45 prompt tokens + 2 of the 3 generated (the last sampled token never had KV computed)
    assert hits.tokens == [0, 40, 47]
    assert hits.blocks == [0, 32, 32]
    a1_longer = a0 + [70, 71, 72, 73, 74] + [80]  # 5 generated: 45 + 4 = 49 -> 3 blocks
    hits = ideal_hits([SentPrompt(a0, 5, None), SentPrompt(a1_longer, 1, 0)], page_size=16)
    assert hits.tokens == [0, 49] and hits.blocks == [0, 48]


def test_without_generated_tokens_only_the_prompt_counts():
    a0 = list(range(20))
    a1 = a0 + [50, 51, 52, 53]
    assert ideal_hits([SentPrompt(a0, 0, None), SentPrompt(a1, 0, 0)]).tokens == [0, 20]
    # Not the same agent's previous turn: its generated tokens are nobody else's prefix.
    assert ideal_hits([SentPrompt(a0, 3, None), SentPrompt(a1, 0, None)]).tokens == [0, 20]
    assert ideal_hits([SentPrompt(a0, 1, None), SentPrompt(a1, 0, 0)]).tokens == [0, 20]


def test_previous_turn_that_is_not_a_prefix_adds_nothing():
    a0 = [1, 2, 3, 4]
    a1 = [1, 2, 9, 9, 9, 9]  # history was rewritten (e.g. a template that drops a token)
    assert ideal_hits([SentPrompt(a0, 3, None), SentPrompt(a1, 0, 0)]).tokens == [0, 2]


def test_full_repeat_stops_one_token_short():
    prompt = list(range(33))
    hits = ideal_hits([SentPrompt(prompt, 0, None), SentPrompt(prompt, 0, None)], page_size=16)
    assert hits.tokens == [0, 32]
    assert hits.blocks == [0, 32]
    hits = ideal_hits([SentPrompt(prompt[:32], 0, None), SentPrompt(prompt[:32], 0, None)],
                      page_size=16)
    assert hits.tokens == [0, 31] and hits.blocks == [0, 16]


def test_bad_arguments():
    with pytest.raises(ValueError, match="page_size"):
        ideal_hits([], page_size=0)
    with pytest.raises(ValueError, match="previous"):
        ideal_hits([SentPrompt([1], 0, 0)])
