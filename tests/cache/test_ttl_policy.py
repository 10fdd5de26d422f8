"""The learned retention TTL (cache/ttl_policy.py): pauses measured per (tenant, agent) with an
injected clock; the prior before 8 of them, margin x p90 after, capped by the prefix's
recompute cost; bounded keys."""

from __future__ import annotations

import pytest

from prefixgate.cache.ttl_policy import MAX_TTL_S, MIN_TTL_S, RecomputeCost, TTLPolicy


class Clock:
    def __init__(self) -> None:
        self.now = 500.0

    def __call__(self) -> float:
        return self.now


def policy_with_clock(**kwargs) -> tuple[TTLPolicy, Clock]:
    clock = Clock()
    # 1 ms/token and a 300x cap: a 2,000-token prefix may be held 600 s
    return TTLPolicy(30.0, clock=clock, recompute=RecomputeCost(1e-3), **kwargs), clock


def pause(policy: TTLPolicy, clock: Clock, tenant: str, agent: str, seconds: float) -> None:
    policy.tool_call_ended(tenant, agent)
    clock.now += seconds
    assert policy.request_arrived(tenant, agent) == pytest.approx(min(seconds, MAX_TTL_S))


def test_the_prior_until_enough_pauses_then_the_margin_times_p90():
    policy, clock = policy_with_clock()
    for seconds in (1, 2, 3, 4, 5, 6, 7):
        pause(policy, clock, "t", "coder", seconds)
    assert policy.decide("t", "coder", 2000) == (30.0, "prior", None, None)  # 7 < 8 pauses
    pause(policy, clock, "t", "coder", 8)
    decision = policy.decide("t", "coder", 2000)
    # p90 of 1..8 by nearest rank is the 8th of 8 (ceil(7.2) = 8): 8 s x 1.25
    assert decision.source == "agent" and decision.pause_quantile_s == 8
    assert decision.ttl_s == pytest.approx(10.0) and decision.cap_s == pytest.approx(600.0)
    for seconds in (1, 1):  # 10 pauses: p90 = the 9th smallest = 7 s
        pause(policy, clock, "t", "coder", seconds)
    assert policy.ttl("t", "coder", 2000) == pytest.approx(7 * 1.25)


def test_a_request_without_a_pending_tool_end_is_no_pause():
    policy, clock = policy_with_clock()
    assert policy.request_arrived("t", "coder") is None  # never ended in tool calls
    pause(policy, clock, "t", "coder", 3)
    clock.now += 100
    assert policy.request_arrived("t", "coder") is None  # its pause already ended
    assert policy.request_arrived("t", None) is None
    policy.tool_call_ended("t", None)  # unlabelled: nothing to learn from
    assert policy.num_tracked == 1


def test_the_cap_grows_with_the_prefix_recompute_cost():
    policy, clock = policy_with_clock()
    for _ in range(8):
        pause(policy, clock, "t", "slow-tool", 500)  # p90 500 s -> 625 s wanted
    assert policy.ttl("t", "slow-tool", 4000) == pytest.approx(625.0)  # cap 1,200 s: not binding
    assert policy.ttl("t", "slow-tool", 1000) == pytest.approx(300.0)  # 1 s recompute x 300
    assert policy.ttl("t", "slow-tool", 64) == pytest.approx(64 * 1e-3 * 300)
    assert policy.ttl("t", "slow-tool", 1) == MIN_TTL_S  # never below the floor
    # a measured cost replaces the constant: 4x cheaper recompute, 4x shorter cap
    for _ in range(4):
        policy.recompute.observe(0.25, 1000)
    assert policy.recompute.s_per_token == pytest.approx(2.5e-4)
    assert policy.ttl("t", "slow-tool", 1000) == pytest.approx(75.0)
    assert policy.decide("t", "slow-tool", None).ttl_s == pytest.approx(625.0)  # uncapped view


def test_recompute_cost_ignores_small_prefills_and_takes_the_median():
    cost = RecomputeCost(1e-3, min_tokens=64, min_samples=3)
    cost.observe(5.0, 10)  # too few tokens computed to say anything
    cost.observe(float("inf"), 100)
    assert cost.num_samples == 0 and cost.s_per_token == 1e-3
    for seconds in (0.1, 0.2, 9.0):  # one request queued behind a long prefill
        cost.observe(seconds, 100)
    assert cost.s_per_token == pytest.approx(2e-3)  # the median shrugs off the outlier
    assert cost.seconds(500) == pytest.approx(1.0)


def test_pauses_are_clamped_and_a_long_one_reaches_the_cap():
    policy, clock = policy_with_clock()
    for _ in range(8):
        pause(policy, clock, "t", "human-in-the-loop", 10 * MAX_TTL_S)
    assert policy.decide("t", "human-in-the-loop", 2000).pause_quantile_s == MAX_TTL_S
    assert policy.ttl("t", "human-in-the-loop", 10**7) == MAX_TTL_S


def test_a_new_agent_inherits_its_tenants_pauses_not_another_tenants():
    policy, clock = policy_with_clock()
    for i in range(8):
        pause(policy, clock, "alpha", f"worker-{i}", 2)  # one pause each: no agent has 8
    assert policy.decide("alpha", "worker-0", 2000).source == "tenant"
    assert policy.ttl("alpha", "worker-new", 2000) == pytest.approx(2.5)
    assert policy.ttl("alpha", None, 2000) == pytest.approx(2.5)
    assert policy.decide("beta", "worker-0", 2000).source == "prior"  # tenants never mix
    assert policy.agents("alpha")["worker-3"].num_pauses == 1
    assert policy.agents("beta") == {} and policy.tenants() == ["alpha"]


def test_tracked_keys_are_bounded_least_recently_used_first():
    policy, clock = policy_with_clock(max_keys=3)
    for agent in ("a", "b", "c"):
        pause(policy, clock, "t", agent, 1)
    pause(policy, clock, "t", "a", 1)  # a is the most recent now
    pause(policy, clock, "t", "d", 1)  # evicts b, the least recently used
    assert policy.num_tracked == 3
    assert set(policy.agents("t")) == {"a", "c", "d"}
    # b's pause lives on in the tenant's pooled window (the fold): 5 pauses there
    assert len(policy._tenants["t"]) == 5


def test_learning_off_and_retention_off():
    clock = Clock()
    off = TTLPolicy(30.0, learn=False, clock=clock)
    for _ in range(10):
        off.tool_call_ended("t", "a")
        clock.now += 1
        assert off.request_arrived("t", "a") is None
    assert off.ttl("t", "a", 2000) == 30.0 and off.num_tracked == 0
    disabled, clock = policy_with_clock()
    disabled.prior_s = 0.0
    for _ in range(8):
        pause(disabled, clock, "t", "a", 2)
    assert disabled.decide("t", "a", 2000) == (0.0, "off", None, None)
    with pytest.raises(ValueError):
        TTLPolicy(-1.0)
    with pytest.raises(ValueError):
        TTLPolicy(30.0, quantile=0.0)
