"""Workload generation: deterministic per seed, growing histories, shared group prefixes."""

from __future__ import annotations

import dataclasses
import json

import pytest

from prefixgate.agents.texts import approx_tokens, truncate_tokens
from prefixgate.agents.workload import SwarmConfig, build_workload

CONFIG = SwarmConfig(groups=3, agents_per_group=4, turns=4, system_tokens=600, task_tokens=80,
                     followup_tokens=80, seed=7)


def test_same_seed_same_workload_other_seed_other_text():
    assert build_workload(CONFIG) == build_workload(CONFIG)
    other = build_workload(dataclasses.replace(CONFIG, seed=8))
    assert [a.system for a in other.agents] != [a.system for a in build_workload(CONFIG).agents]
    assert [a.task for a in other.agents] != [a.task for a in build_workload(CONFIG).agents]


def test_histories_grow_turn_by_turn():
    workload = build_workload(CONFIG)
    assert workload.num_requests == 3 * 4 * 4
    for agent in workload.agents:
        replies = [f"reply {turn} of {agent.agent_id}" for turn in range(agent.turns - 1)]
        previous = agent.messages([])
        assert [m["role"] for m in previous] == ["system", "user"]
        for turn in range(1, agent.turns):
            current = agent.messages(replies[:turn])
            assert current[:len(previous)] == previous  # the whole earlier prefix is re-sent
            assert current[len(previous)] == {"role": "assistant", "content": replies[turn - 1]}
            assert current[len(previous) + 1] == {"role": "user",
                                                  "content": agent.followups[turn - 1]}
            assert len(current) == len(previous) + 2
            previous = current
        with pytest.raises(ValueError, match="turns"):
            agent.messages(replies + ["one too many"])


def test_prefix_shared_within_group_and_distinct_across_groups():
    workload = build_workload(CONFIG)
    systems: dict[int, set[str]] = {}
    for agent in workload.agents:
        systems.setdefault(agent.group, set()).add(agent.system)
    assert all(len(texts) == 1 for texts in systems.values())
    assert len({next(iter(texts)) for texts in systems.values()}) == CONFIG.groups
    tasks = [agent.task for agent in workload.agents]
    assert len(set(tasks)) == len(tasks)
    ids = [agent.agent_id for agent in workload.agents]
    assert len(set(ids)) == len(ids) and ids[:3] == ["g0-a0", "g1-a0", "g2-a0"]


def test_lengths_follow_the_token_budgets():
    workload = build_workload(CONFIG)
    for agent in workload.agents:
        assert approx_tokens(agent.system) == CONFIG.system_tokens
        assert approx_tokens(agent.task) == CONFIG.task_tokens
        for followup in agent.followups:
            assert 0.5 * CONFIG.followup_tokens <= approx_tokens(followup) \
                <= CONFIG.followup_tokens + 1
    assert "# Tools" in workload.agents[0].system  # realistic: schemas embedded as JSON
    assert any(f.startswith("Result of tool `") for a in workload.agents for f in a.followups)


def test_tools_field_moves_schemas_out_of_the_system_text():
    workload = build_workload(dataclasses.replace(CONFIG, tools_field=True))
    agent = workload.agents[0]
    assert agent.tools and "# Tools" not in agent.system
    for tool in agent.tools:
        assert tool["type"] == "function"
        json.dumps(tool)  # plain JSON
        assert tool["function"]["parameters"]["type"] == "object"


def test_arrivals():
    burst = build_workload(CONFIG)
    assert {a.start_s for a in burst.agents} == {0.0}
    staggered = build_workload(dataclasses.replace(CONFIG, arrival="staggered", interval_s=0.25))
    assert [a.start_s for a in staggered.agents] == [k * 0.25 for k in range(12)]
    poisson = build_workload(dataclasses.replace(CONFIG, arrival="poisson", rate=2.0))
    starts = [a.start_s for a in poisson.agents]
    assert starts[0] == 0.0 and starts == sorted(starts) and len(set(starts)) == len(starts)
    assert starts == [a.start_s for a in build_workload(
        dataclasses.replace(CONFIG, arrival="poisson", rate=2.0)).agents]


@pytest.mark.parametrize(("field", "value"), [("groups", 0), ("turns", 0), ("max_tokens", 0),
                                              ("arrival", "flood"), ("rate", 0.0),
                                              ("interval_s", -1.0), ("concurrency", 0)])
def test_bad_config_names_the_field(field, value):
    with pytest.raises(ValueError, match=field.split("_s")[0]):
        SwarmConfig(**{field: value})


def test_truncate_tokens():
    text = 'Call {"tool": "x"} now, please.'
    assert approx_tokens(text) == 14
    assert truncate_tokens(text, 3) == 'Call {"'
    assert truncate_tokens(text, 100) == text
    assert truncate_tokens(text, 0) == ""
