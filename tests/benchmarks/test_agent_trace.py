"""benchmarks.agent_trace: the generated trace follows the Mooncake format, benchmarks.trace
reads it back into the sessions it modelled (tool loops, sub-agent forks), and it has the
agent shape (a long shared system prompt, short outputs, heavy-tailed pauses)."""

import json
import statistics
from collections import Counter

import pytest

from benchmarks import agent_trace as gen
from benchmarks import trace_workload as tw

CONFIG = gen.AgentTraceConfig(agents=6, turns=6, fork_prob=0.5, seed=3)


@pytest.fixture(scope="module")
def written(tmp_path_factory):
    path = tmp_path_factory.mktemp("agent") / "trace.jsonl"
    assert gen.main(["--out", str(path), "--agents", "6", "--turns", "6", "--fork-prob", "0.5",
                     "--seed", "3"]) == 0
    return path


def test_the_trace_is_in_the_mooncake_format(written):
    rows = [json.loads(line) for line in written.read_text().splitlines()]
    assert rows == gen.generate(CONFIG)  # the CLI writes what generate() makes: deterministic
    assert all(set(row) == {"timestamp", "input_length", "output_length", "hash_ids"}
               for row in rows)
    assert all(len(row["hash_ids"]) == -(-row["input_length"] // tw.TRACE_BLOCK) for row in rows)
    assert [row["timestamp"] for row in rows] == sorted(row["timestamp"] for row in rows)
    assert gen.generate(gen.AgentTraceConfig(agents=6, seed=4)) != gen.generate(
        gen.AgentTraceConfig(agents=6, seed=3))


def test_benchmarks_trace_rebuilds_the_agents_and_their_forks(written):
    requests = tw.load_trace(written)
    links = tw.link_sessions(requests)
    assert len({link.session for link in links}) == CONFIG.agents  # sub-agents join their parent
    children = Counter(link.parent for link in links if link.parent is not None)
    assert any(count > 1 for count in children.values())  # a fork: several continue one request
    positions = tw.select(requests, links, tw.Selection(sessions=99, min_turns=1, max_turns=99))
    replay = tw.build_replay(requests, links, positions, tw.Scaling(scale=16))
    assert len(replay) == len(requests)
    for request in replay:
        if request.parent is not None:  # every turn re-sends its parent's full blocks
            parent = replay[request.parent].prompt
            full = len(parent) // 32 * 32
            assert request.prompt[:full] == parent[:full]


def test_it_has_the_agent_shape(written):
    rows = [json.loads(line) for line in written.read_text().splitlines()]
    system_blocks = CONFIG.system_tokens // tw.TRACE_BLOCK
    shared = rows[0]["hash_ids"][:system_blocks]
    assert all(row["hash_ids"][:system_blocks] == shared for row in rows)  # one system prompt
    assert all(10 <= row["output_length"] <= 400 for row in rows)  # short tool calls
    requests = tw.load_trace(written)
    links = tw.link_sessions(requests)
    gaps = [requests[p].timestamp_ms - requests[link.parent].timestamp_ms
            for p, link in enumerate(links) if link.parent is not None]
    assert max(gaps) > 5 * statistics.median(gaps)  # heavy-tailed pauses
    assert max(row["input_length"] for row in rows) <= CONFIG.max_context + 20_000 + 400


def test_bad_settings_are_refused():
    with pytest.raises(ValueError, match="agents must be >= 1"):
        gen.AgentTraceConfig(agents=0)
    with pytest.raises(ValueError, match="fork_prob"):
        gen.AgentTraceConfig(fork_prob=2)
    with pytest.raises(SystemExit):
        gen.main(["--out", "x.jsonl", "--turns", "0"])
