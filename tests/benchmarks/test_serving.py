"""benchmarks.serving, the pure parts: the seeded swarm, request bodies and the conversation's
growth, SSE chunk folding, the percentile helper, summaries and the prefixgate / peer ratios,
peer discovery (no server, no model)."""

import pytest

from benchmarks import serving as bench


def test_swarm_is_deterministic_given_the_seed():
    settings = bench.Settings(agents=3, turns=3, prompt_tokens=300)
    first, again = bench.build_swarm(settings), bench.build_swarm(settings)
    assert first == again
    other = bench.build_swarm(bench.Settings(agents=3, turns=3, prompt_tokens=300, seed=1))
    assert [a.task for a in other.agents] != [a.task for a in first.agents]
    assert len(first.agents) == 3
    assert len({a.system for a in first.agents}) == 1  # one shared system prompt
    assert len({a.task for a in first.agents}) == 3  # each agent its own task
    assert all(a.turns == 3 and a.start_s == 0.0 for a in first.agents)  # a burst
    assert all(not a.tools for a in first.agents)  # schemas embedded in the text


def test_tool_loop_swarm_sends_bounded_tools():
    agent = bench.build_swarm(bench.Settings(agents=2, turns=2, tool_loop=True)).agents[0]
    tools = bench.tool_specs(agent)
    assert tools and all(t["type"] == "function" for t in tools)
    assert '"maxLength": 12' in str(tools).replace("'", '"')
    assert bench.tool_specs(agent) == tools
    assert agent.tools[0]["function"]["parameters"] != tools[0]["function"]["parameters"]


def test_bounded_schema_caps_every_size():
    schema = {"type": "object", "properties": {
        "url": {"type": "string", "format": "uri"},
        "mode": {"type": "string", "enum": ["a", "b"]},
        "n": {"type": "integer", "maximum": 10**6},
        "ids": {"type": "array", "items": {"type": "string", "maxLength": 40}},
        "tags": {"type": "object", "additionalProperties": {"type": "string"}}}}
    props = bench.bounded_schema(schema)["properties"]
    assert props["url"] == {"type": "string", "maxLength": 12}
    assert props["mode"] == {"type": "string", "enum": ["a", "b"]}
    assert props["n"]["maximum"] == 1000
    assert props["ids"]["maxItems"] == 2 and props["ids"]["items"]["maxLength"] == 12
    assert props["tags"]["maxProperties"] == 2


def test_request_bodies():
    settings = bench.Settings(agents=1, turns=2)
    messages = [{"role": "user", "content": "hi"}]
    body = bench.request_body(settings, "m", messages, None, "g0-a0")
    assert body["ignore_eos"] is True and body["max_tokens"] == 32 and body["stream"] is True
    assert body["temperature"] == 0 and body["stream_options"] == {"include_usage": True}
    assert "tools" not in body
    plain = bench.Settings(ignore_eos=False)
    assert "ignore_eos" not in bench.request_body(plain, None, messages, None, "a")
    assert "model" not in bench.request_body(plain, None, messages, None, "a")
    tool = bench.Settings(tool_loop=True, tool_max_tokens=48)
    body = bench.request_body(tool, "m", messages, [{"type": "function"}], "a")
    assert body["tool_choice"] == "required" and body["parallel_tool_calls"] is False
    assert body["max_tokens"] == 48 and "ignore_eos" not in body


def test_each_turn_extends_the_conversation():
    settings = bench.Settings(agents=1, turns=3, prompt_tokens=200)
    agent = bench.build_swarm(settings).agents[0]
    first = agent.messages([])
    second = bench.next_messages(settings, 0, agent, first, 0, bench.Reply("answer"))
    assert second[: len(first)] == first
    assert second[len(first):] == [{"role": "assistant", "content": "answer"},
                                   {"role": "user", "content": agent.followups[0]}]
    assert second == agent.messages(["answer"])  # the workload's own history

    tool = bench.Settings(agents=1, turns=3, prompt_tokens=200, tool_loop=True)
    agent = bench.build_swarm(tool).agents[0]
    call = {"id": "c1", "name": "search_logs", "arguments": '{"q": "x"}'}
    grown = bench.next_messages(tool, 0, agent, first, 1, bench.Reply("", [call]))
    assistant, result = grown[len(first):]
    assert assistant["tool_calls"][0]["function"] == {"name": "search_logs",
                                                      "arguments": '{"q": "x"}'}
    assert assistant["content"] is None
    assert result["role"] == "tool" and result["tool_call_id"] == "c1"
    assert result["content"] == bench.tool_result_text(tool, 0, 1, "search_logs")
    assert result["content"] != bench.tool_result_text(tool, 1, 1, "search_logs")
    # a reply with no call (a peer ignoring tools) goes back as text with a follow-up
    texty = bench.next_messages(tool, 0, agent, first, 0, bench.Reply("plain"))
    assert texty[-1] == {"role": "user", "content": agent.followups[0]}


def test_fold_chunk_collects_text_tool_calls_and_usage():
    record = bench.Record(agent=0, turn=0, start_s=0.0)
    text, calls = [], {}
    assert not bench._fold_chunk({"choices": [{"delta": {"role": "assistant", "content": ""}}]},
                                 record, text, calls)
    assert bench._fold_chunk({"choices": [{"delta": {"content": "Hi"}}]}, record, text, calls)
    delta = {"tool_calls": [{"index": 0, "id": "c", "function": {"name": "f", "arguments": ""}}]}
    assert bench._fold_chunk({"choices": [{"delta": delta}]}, record, text, calls)
    delta = {"tool_calls": [{"index": 0, "function": {"arguments": "{}"}}]}
    bench._fold_chunk({"choices": [{"delta": delta, "finish_reason": "tool_calls"}]},
                      record, text, calls)
    usage = {"prompt_tokens": 100, "completion_tokens": 7,
             "prompt_tokens_details": {"cached_tokens": 96}}
    assert not bench._fold_chunk({"choices": [], "usage": usage}, record, text, calls)
    assert text == ["Hi"] and calls == {0: {"id": "c", "name": "f", "arguments": "{}"}}
    assert (record.prompt_tokens, record.completion_tokens, record.cached_tokens) == (100, 7, 96)
    assert record.finish_reason == "tool_calls"
    with pytest.raises(ValueError, match="boom"):
        bench._fold_chunk({"error": {"message": "boom"}}, record, text, calls)


def test_percentile_interpolates_between_ranks():
    assert bench.percentile([], 50) is None
    assert bench.percentile([3.0], 90) == 3.0
    assert bench.percentile([4.0, 1.0, 3.0, 2.0], 50) == 2.5
    assert bench.percentile([1.0, 2.0, 3.0, 4.0], 90) == pytest.approx(3.7)
    assert bench.percentile(list(range(11)), 0) == 0 and bench.percentile(list(range(11)), 100) == 10


def _record(turn, ttft, completion=32, cached=None, error=None, chunks=32):
    return bench.Record(agent=0, turn=turn, start_s=0.0, ttft_s=ttft, e2e_s=ttft + 1,
                        prompt_tokens=100, completion_tokens=completion, cached_tokens=cached,
                        output_chunks=chunks, finish_reason="length", error=error)


def test_summarize_counts_successes_and_known_usage():
    records = [_record(0, 1.0, cached=0), _record(1, 0.2, cached=96), _record(1, 0.4, cached=96),
               _record(1, 9.0, error="HTTP 500: x")]
    summary = bench.summarize(records, wall_s=4.0)
    assert (summary["requests"], summary["ok"], summary["errors"]) == (4, 3, 1)
    assert summary["first_error"] == "HTTP 500: x"
    assert summary["ttft_p50_s"] == 0.4 and summary["ttft_p50_turn1_s"] == 1.0
    assert summary["ttft_p50_later_s"] == pytest.approx(0.3)
    assert summary["output_tokens"] == 96 and summary["output_tokens_per_s"] == 24.0
    assert summary["output_tokens_source"] == "usage"
    assert summary["cached_tokens"] == 192 and summary["hit_rate"] == pytest.approx(0.64)
    # a server without usage: chunks stand in for tokens, cached tokens are unknown
    bare = bench.summarize([_record(0, 1.0, completion=None, chunks=30)], wall_s=2.0)
    assert bare["output_tokens"] == 30 and bare["output_tokens_source"] == "chunks"
    assert bare["cached_tokens"] is None and bare["hit_rate"] is None


def test_ratios_are_prefixgate_over_peer():
    ours = {"ok": 64, "wall_s": 6.0, "ttft_p50_s": 0.3, "ttft_p90_s": 1.0,
            "output_tokens_per_s": 300.0, "rss_tree_mb": 900.0}
    theirs = {"ok": 64, "wall_s": 12.0, "ttft_p50_s": 0.6, "ttft_p90_s": 0.0,
              "output_tokens_per_s": 150.0, "rss_tree_mb": None}
    got = bench.ratios(ours, theirs)
    assert got["wall_ratio"] == 0.5 and got["ttft_p50_ratio"] == 0.5
    assert got["output_tokens_per_s_ratio"] == 2.0
    assert got["ttft_p90_ratio"] is None and got["rss_tree_ratio"] is None  # 0 / unknown
    assert set(bench.ratios(ours, None).values()) == {None}
    assert set(bench.ratios(ours, {**theirs, "ok": 0}).values()) == {None}  # peer failed
    assert bench.ratio(1.0, 4.0) == 0.25 and bench.ratio(None, 1.0) is None


def test_peer_discovery(tmp_path, capsys):
    assert bench.peer_command("vllm", tmp_path, 8001, 16) is None
    assert "vllm_cpu.sh" in bench.setup_command("vllm", tmp_path)
    serve = tmp_path / "llama-server" / "serve.sh"
    serve.parent.mkdir()
    serve.write_text("#!/bin/sh\n")
    serve.chmod(0o755)
    assert bench.peer_command("llama-server", tmp_path, 8001, 16) == [str(serve), "8001", "16"]
    # not installed: the setup command and a non-zero exit, before any server starts
    assert bench.main(["--peer", "vllm", "--peers-dir", str(tmp_path)]) == 2
    assert "vllm_cpu.sh" in capsys.readouterr().err
