"""benchmarks.trace_workload: reading the trace, rebuilding sessions from hash prefixes,
selecting them, and scaling hash ids into token ids and times (pure: no server)."""

import json

import pytest

from benchmarks import trace_workload as tw

# A tiny trace (trace blocks of 512 tokens):
#   0: session A, turn 0: 2 full blocks + a partial one
#   1: session B: shares A's first block only (a common system prompt): its own session
#   2: A, turn 1: A's full blocks [1, 2], then new blocks (A's partial block 3 became 4)
#   3: A, turn 1 again: a fork, also from A's turn 0
#   4: A, turn 2: continues request 2 (all of its 4 full blocks)
ROWS = [
    {"timestamp": 0, "input_length": 1200, "output_length": 64, "hash_ids": [1, 2, 3]},
    {"timestamp": 500, "input_length": 700, "output_length": 10, "hash_ids": [1, 9]},
    {"timestamp": 3000, "input_length": 2048, "output_length": 32, "hash_ids": [1, 2, 4, 5]},
    {"timestamp": 4000, "input_length": 1100, "output_length": 500, "hash_ids": [1, 2, 6]},
    {"timestamp": 9000, "input_length": 2600, "output_length": 1, "hash_ids": [1, 2, 4, 5, 7, 8]},
]


@pytest.fixture()
def trace(tmp_path):
    path = tmp_path / "trace.jsonl"
    path.write_text("\n".join(json.dumps(row) for row in ROWS) + "\n\n")
    return tw.load_trace(path)


def test_load_trace_reads_every_line_in_timestamp_order(tmp_path, trace):
    assert [r.timestamp_ms for r in trace] == [0, 500, 3000, 4000, 9000]
    assert trace[2].hash_ids == (1, 2, 4, 5) and trace[2].full_blocks(512) == (1, 2, 4, 5)
    assert trace[0].full_blocks(512) == (1, 2)  # the third block is partial
    shuffled = tmp_path / "shuffled.jsonl"
    shuffled.write_text("\n".join(json.dumps(row) for row in reversed(ROWS)))
    assert [r.index for r in tw.load_trace(shuffled)] == [4, 3, 2, 1, 0]


@pytest.mark.parametrize(("line", "message"), [
    ("{not json", "line 2: JSONDecodeError"),
    ('{"timestamp": 1, "input_length": 10, "output_length": 1}', "line 2: KeyError"),
    ('{"timestamp": 1, "input_length": 1100, "output_length": 1, "hash_ids": [1, 2]}',
     "needs 3 hash ids of 512 tokens, got 2"),
])
def test_load_trace_names_the_bad_line(tmp_path, line, message):
    path = tmp_path / "bad.jsonl"
    path.write_text(json.dumps(ROWS[0]) + "\n" + line + "\n")
    with pytest.raises(tw.TraceError, match=message):
        tw.load_trace(path)


def test_sessions_are_rebuilt_from_hash_prefixes(trace):
    links = tw.link_sessions(trace)
    assert [(link.parent, link.session, link.turn) for link in links] == [
        (None, 0, 0),  # A opens
        (None, 1, 0),  # B shares a block but covers no whole earlier prompt
        (0, 0, 1),  # A's next turn: its full blocks [1, 2] repeated
        (0, 0, 1),  # a fork from the same turn
        (2, 0, 2),  # continues the longest covered prompt, not only A's first turn
    ]


def test_select_keeps_sessions_with_enough_turns_and_cuts_deep_ones(trace):
    links = tw.link_sessions(trace)
    assert tw.select(trace, links, tw.Selection(sessions=5, min_turns=1)) == [0, 1, 2, 3, 4]
    assert tw.select(trace, links, tw.Selection(sessions=5, min_turns=2)) == [0, 2, 3, 4]
    assert tw.select(trace, links, tw.Selection(sessions=5, min_turns=1, max_turns=2)) == [0, 1, 2, 3]
    assert tw.select(trace, links, tw.Selection(sessions=1, min_turns=1)) == [0, 2, 3, 4]
    sampled = {tuple(tw.select(trace, links, tw.Selection(sessions=1, min_turns=1, seed=s)))
               for s in range(20)}
    assert sampled == {(0, 2, 3, 4), (1,)}  # a seeded sample draws either session
    with pytest.raises(ValueError, match=">= 1"):
        tw.Selection(sessions=0)


def test_hash_ids_map_to_blocks_shared_token_for_token(trace):
    scaling = tw.Scaling(scale=32)  # 16 tokens a block
    first, fork = (tw.prompt_token_ids(trace[i], scaling) for i in (0, 3))
    assert len(first) == 1200 // 32 == 37
    assert first[:32] == fork[:32]  # blocks 1 and 2, token for token
    assert first[32:37] != fork[32:37]  # blocks 3 and 6 differ
    assert first[:16] == tw.block_token_ids(1, 16) and first[16:32] == tw.block_token_ids(2, 16)
    assert first[32:] == tw.block_token_ids(3, 16)[:5]  # the partial block: a cut full one
    assert tw.prompt_token_ids(trace[0], scaling) == first  # deterministic
    assert tw.block_token_ids(1, 16, token_seed=1) != tw.block_token_ids(1, 16)
    assert all(tw.TOKEN_LOW <= t < tw.TOKEN_HIGH for t in first)
    # a tiny last block still shows: at least one token of it
    tiny = tw.TraceRequest(0, 0, 513, 1, (1, 2))
    assert len(tw.prompt_token_ids(tiny, scaling)) == 17
    with pytest.raises(ValueError, match="must divide"):
        tw.Scaling(scale=3)


def test_replay_times_outputs_and_parents(trace):
    links = tw.link_sessions(trace)
    positions = tw.select(trace, links, tw.Selection(min_turns=1))
    scaling = tw.Scaling(scale=32, output_scale=2, max_output=100, time_scale=0.5)
    replay = tw.build_replay(trace, links, positions, scaling)
    assert [(r.session, r.parent, r.turn) for r in replay] == [
        (0, None, 0), (1, None, 0), (0, 0, 1), (0, 0, 1), (0, 2, 2)]
    assert [r.at_s for r in replay] == [0.0, 0.25, 1.5, 2.0, 4.5]
    assert [r.gap_s for r in replay] == [0.0, 0.0, 1.5, 2.0, 3.0]  # after the parent's send
    assert [r.max_tokens for r in replay] == [32, 5, 16, 100, 1]  # /2, capped, at least 1
    # the chain 0 -> 2 -> 4 : 0 + 1.5 + 3.0 is the longest
    assert tw.closed_loop_floor(replay) == pytest.approx(4.5)
    # selection that drops the parent turns its child's gap into a first turn's
    cut = tw.build_replay(trace, links, [1], scaling)
    assert cut[0].parent is None and cut[0].at_s == 0.0


def test_describe_counts_the_working_set_once(trace):
    links = tw.link_sessions(trace)
    replay = tw.build_replay(trace, links, [0, 2], tw.Scaling(scale=32))
    figures = tw.describe(replay, 16)
    # full blocks: [1, 2] of request 0, and [1, 2, 4, 5] of request 2: 4 distinct; tails 5 + 0
    assert figures["prompt_tokens"] == 37 + 64
    assert figures["working_set_tokens"] == 4 * 16 + 5
    assert figures["reusable_fraction"] == pytest.approx(1 - 69 / 101)
    assert (figures["requests"], figures["sessions"], figures["returning_requests"]) == (2, 1, 1)
