"""The runner against a live (fake, misbehaving) OpenAI-compatible server on loopback."""

from __future__ import annotations

import asyncio

import pytest

from prefixgate.agents.report import summarize
from prefixgate.agents.runner import Endpoint, run_workload
from prefixgate.agents.workload import SwarmConfig, build_workload

from .conftest import free_port, render

pytestmark = pytest.mark.slow  # starts a server

SMALL = SwarmConfig(groups=2, agents_per_group=2, turns=3, system_tokens=200, task_tokens=40,
                    followup_tokens=40, max_tokens=3, concurrency=3, seed=3)


def run(url: str, config: SwarmConfig = SMALL, **kwargs):
    endpoint = Endpoint("A", url, api_key="sk-test")
    return asyncio.run(run_workload(build_workload(config), endpoint, **kwargs))


def test_happy_path_records_everything(fake_server):
    fake_server.reset()
    result = run(f"{fake_server.url}/ok/v1")  # a trailing /v1 is accepted
    assert [r.send_index for r in result.records] == list(range(12))
    assert all(r.ok for r in result.records), [r.error for r in result.records]
    for r in result.records:
        assert r.ttft_s is not None and 0 < r.ttft_s <= r.e2e_s
        assert len(r.itl_s) == 2 and r.output_chunks == 3 and r.completion_tokens == 3
        assert r.finish_reason == "length"
        assert r.tokenized_len == r.prompt_tokens  # /tokenize agrees with usage
        assert r.cached_tokens <= r.ideal_block_tokens <= r.ideal_tokens < r.prompt_tokens
    assert result.tokenize == "ok"
    # Each agent identifies itself in `user` and X-Agent-Id; the key travels as a bearer token.
    assert {entry["agent"] for entry in fake_server.log} == {"g0-a0", "g0-a1", "g1-a0", "g1-a1"}
    assert all(entry["agent"] == entry["user"] for entry in fake_server.log)
    assert {entry["auth"] for entry in fake_server.log} == {"Bearer sk-test"}
    body = fake_server.log[0]["body"]
    assert body["stream"] is True and body["stream_options"] == {"include_usage": True}
    assert body["model"] == result.model == "fake-model"  # from GET /v1/models
    # Real multi-turn history: turn t re-sends turn t-1 plus the reply the server streamed.
    by_agent = {}
    for entry in fake_server.log:
        by_agent.setdefault(entry["agent"], []).append(entry["body"]["messages"])
    for turns in by_agent.values():
        assert len(turns) == 3
        for before, after in zip(turns, turns[1:], strict=False):
            assert after[:len(before)] == before
            assert after[len(before)] == {"role": "assistant", "content": " w0 w1 w2"}
    # Later turns hit the previous turn's prefix; turn 0 of the second agent of a group hits
    # the shared system prompt in the ideal cache only.
    summary = summarize([result])
    assert 0 < summary.achieved_hit_rate <= summary.ideal_block_hit_rate \
        <= summary.ideal_hit_rate < 1
    first_turns = [r for r in result.records if r.turn == 0]
    assert first_turns[0].ideal_tokens == 0
    shared_system = len(render([{"role": "system", "content": build_workload(SMALL).agents[0]
                                 .system}])) - len("<|assistant|>")
    assert max(r.ideal_tokens for r in first_turns) >= shared_system


def test_mixed_failures_are_recorded_and_the_run_completes(fake_server):
    result = run(f"{fake_server.url}/mixed", tokenize=False)
    assert len(result.records) == 12  # agents carry on after a failed turn
    kinds = [r.error_kind for r in result.records]
    assert set(kinds) == {None, "http_500", "bad_sse", "disconnected", "truncated"}
    errors = summarize([result]).errors
    assert sum(errors.values()) == sum(kind is not None for kind in kinds)
    http = next(r for r in result.records if r.error_kind == "http_500")
    assert http.status == 500 and http.error == "engine exploded"
    assert result.tokenize.startswith("skipped")


@pytest.mark.parametrize(("mode", "kind"), [("error500", "http_500"), ("badsse", "bad_sse"),
                                            ("badshape", "bad_sse"), ("hangup", "disconnected")])
def test_every_request_failing_the_same_way(fake_server, mode, kind):
    result = run(f"{fake_server.url}/{mode}")
    assert [r.error_kind for r in result.records] == [kind] * 12
    assert all(r.error for r in result.records)
    summary = summarize([result])
    assert summary.ok == 0 and summary.errors == {kind: 12} and summary.ttft_s.p50 is None


def test_hanging_server_times_out(fake_server):
    config = SwarmConfig(groups=1, agents_per_group=2, turns=1, system_tokens=50,
                         task_tokens=20, followup_tokens=20, max_tokens=2)
    result = run(f"{fake_server.url}/hang", config, timeout_s=0.3, tokenize=False)
    assert [r.error_kind for r in result.records] == ["timeout", "timeout"]


def test_unreachable_url():
    result = run(f"http://127.0.0.1:{free_port()}")
    assert [r.error_kind for r in result.records] == ["connect"] * 12
    assert all(r.status is None for r in result.records)
    assert "tokenize" in result.tokenize and "ConnectError" in result.tokenize


def test_server_without_cached_tokens_or_tokenize(fake_server):
    fake_server.reset()
    result = run(f"{fake_server.url}/nocache")
    assert all(r.ok and r.cached_tokens is None and r.ideal_tokens is None
               for r in result.records)
    assert "404" in result.tokenize
    assert result.model is None and "model" not in fake_server.log[-1]["body"]
    summary = summarize([result])
    assert summary.achieved_hit_rate is None and summary.ideal_hit_rate is None
    assert summary.output_tokens == 36


def test_tools_field_sends_the_schemas_with_every_request(fake_server):
    fake_server.reset()
    config = SwarmConfig(groups=1, agents_per_group=1, turns=2, system_tokens=400,
                         task_tokens=20, followup_tokens=40, max_tokens=2, tools_field=True)
    result = run(f"{fake_server.url}/ok", config)
    assert all(r.ok for r in result.records)
    tools = build_workload(config).agents[0].tools
    assert tools and [entry["body"]["tools"] for entry in fake_server.log] == [list(tools)] * 2
