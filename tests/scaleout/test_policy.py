"""Placement policy (pure logic over candidates): affinity, load guard, ties, baselines."""

from __future__ import annotations

from collections import Counter

import pytest

from prefixgate.gateway.router.policy import (
    CacheAwarePolicy,
    Candidate,
    RandomPolicy,
    RoundRobinPolicy,
    least_loaded,
    make_policy,
)

A, B, C = "http://a:8000", "http://b:8000", "http://c:8000"
POLICY = CacheAwarePolicy(abs_threshold=2, rel_threshold=1.5, match_tolerance=0.1)


def test_longest_prefix_wins_when_loads_are_close():
    decision = POLICY.choose([Candidate(A, 900, 3), Candidate(B, 160, 2)], 1000, "s")
    assert decision == (A, "prefix")


def test_a_prefix_every_request_shares_does_not_pile_onto_one_replica():
    # The #1 failure of cache-aware routers: one system prompt for the whole swarm. Simulate
    # placing 40 requests one by one; each holds its replica until the end (worst case).
    loads = {A: 0, B: 0}
    holds = {A: True, B: False}  # only A has computed the shared prompt at first
    for i in range(40):
        candidates = [Candidate(k, 800 if holds[k] else 0, loads[k]) for k in (A, B)]
        key, reason = POLICY.choose(candidates, 1000, f"agent-{i}")
        loads[key] += 1
        holds[key] = True  # it computes the prompt when it is sent there
    assert abs(loads[A] - loads[B]) <= 2, loads


def test_equal_matches_are_decided_by_load_then_session_then_hash():
    near = [Candidate(A, 800, 2), Candidate(B, 790, 1)]  # 2 vs 1: under the guard
    assert POLICY.choose(near, 1000, "s") == (B, "load")
    tied = [Candidate(A, 800, 1, is_session_home=False), Candidate(B, 790, 1, is_session_home=True)]
    assert POLICY.choose(tied, 1000, "s") == (B, "session")
    same = [Candidate(A, 800, 1), Candidate(B, 800, 1)]
    picks = Counter(POLICY.choose(same, 1000, f"user-{i}").key for i in range(200))
    assert picks[A] > 50 and picks[B] > 50, picks  # spread by the session hash
    assert POLICY.choose(same, 1000, "user-7") == POLICY.choose(same, 1000, "user-7")  # stable


def test_a_slightly_longer_match_wins_an_exact_load_tie():
    decision = POLICY.choose([Candidate(A, 800, 1), Candidate(B, 784, 1)], 1000, "s")
    assert decision == (A, "prefix")


def test_load_guard_overrides_affinity():
    # B holds the whole prompt but has 4 more requests than A and 5x its load.
    decision = POLICY.choose([Candidate(A, 0, 1), Candidate(B, 990, 5)], 1000, "s")
    assert decision == (A, "load_guard")
    # Both thresholds must be crossed: 12 vs 10 is only 1.2x.
    decision = POLICY.choose([Candidate(A, 0, 10), Candidate(B, 990, 12)], 1000, "s")
    assert decision == (B, "prefix")
    # The guard keeps the best of the rest: C matches more than A.
    decision = POLICY.choose(
        [Candidate(A, 100, 1), Candidate(B, 990, 6), Candidate(C, 500, 1)], 1000, "s")
    assert decision == (C, "load_guard")


def test_nothing_cached_goes_to_the_least_loaded():
    decision = POLICY.choose([Candidate(A, 0, 2), Candidate(B, 0, 1)], 1000, "s")
    assert decision == (B, "least_loaded")
    assert POLICY.choose([Candidate(A, 500, 9)], 1000, "s") == (A, "only_replica")
    with pytest.raises(ValueError, match="no candidate"):
        POLICY.choose([], 1000, "s")


def test_least_loaded_prefers_the_session_home_on_ties():
    candidates = [Candidate(A, 0, 1), Candidate(B, 0, 1, is_session_home=True)]
    assert least_loaded(candidates, "s", "redis_down") == (B, "redis_down")


def test_baselines():
    candidates = [Candidate(B, 900, 0), Candidate(A, 0, 9)]
    rr = RoundRobinPolicy()
    assert [rr.choose(candidates, 10, "s").key for _ in range(4)] == [A, B, A, B]
    first = [RandomPolicy(seed=3).choose(candidates, 10, "s").key for _ in range(1)]
    again = RandomPolicy(seed=3)
    assert [again.choose(candidates, 10, "s").key for _ in range(1)] == first
    picks = Counter(again.choose(candidates, 10, "s").key for _ in range(400))
    assert 120 < picks[A] < 280, picks
    assert make_policy("round_robin").name == "round_robin"
    with pytest.raises(ValueError, match="unknown routing policy"):
        make_policy("sticky")


def test_fleet_tier_blocks_count_at_their_discount_and_only_where_loadable():
    # Nothing cached in any pool; the fleet's Redis tier holds 800 tokens of the prompt. B and
    # C load from it (discount 0.8); A does not: the tier lifts B and C above an idle A.
    candidates = [Candidate(A, 0, 1), Candidate(B, 0, 1, tier_tokens=800, tier_discount=0.8),
                  Candidate(C, 0, 2, tier_tokens=800, tier_discount=0.8)]
    assert POLICY.choose(candidates, 1000, "s") == (B, "load")
    # A pool match beats the same tokens in the tier (loading is not free) ...
    pool = [Candidate(A, 480, 0), Candidate(B, 0, 0, tier_tokens=480, tier_discount=0.8)]
    assert POLICY.choose(pool, 1000, "s") == (A, "prefix")
    # ... but a longer loadable run beats a short pool match: 160 + 0.8 * 640 > 480
    longer = [Candidate(A, 480, 0), Candidate(B, 160, 0, tier_tokens=640, tier_discount=0.8)]
    assert POLICY.choose(longer, 1000, "s") == (B, "prefix")
    # a discount of 0 (measured: loading costs as much as computing) is no match at all
    free = [Candidate(A, 0, 0), Candidate(B, 0, 1, tier_tokens=800, tier_discount=0.0)]
    assert POLICY.choose(free, 1000, "s") == (A, "least_loaded")
    # the load guard still applies to tier matches
    guarded = [Candidate(A, 0, 0), Candidate(B, 0, 5, tier_tokens=800, tier_discount=1.0)]
    assert POLICY.choose(guarded, 1000, "s") == (A, "load_guard")
