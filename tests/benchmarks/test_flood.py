"""benchmarks.flood: the maximal bodies, the envelope check, and a tiny flood against the live
test gateway (the report's structure and no 5xx; never its timings)."""

import json
import os

import pytest

from benchmarks import flood as bench
from prefixgate.gateway.http.limits import MIB


def test_a_maximal_body_fills_the_body_limit_with_capped_messages():
    workload = bench.FloodWorkload()
    assert workload.num_messages == 31  # 31 x 1 Mi characters, with their JSON, under 32 MiB
    for kind in bench.KINDS[:3]:
        body = bench.flood_body(kind, "m", workload.num_messages, workload.message_chars)
        assert 31 * MIB < len(body) <= 32 * MIB
        data = json.loads(body)
        turns = data["input"] if kind == "responses" else data["messages"]
        assert len(turns) == 31 and {len(t["content"]) for t in turns} == {MIB}
    with pytest.raises(ValueError, match="message_chars"):
        bench.FloodWorkload(body_bytes=4096, message_chars=1 << 20)


def test_the_hostile_schema_mix_builds_each_surfaces_body():
    bodies = {kind: json.loads(bench.schema_body(kind, "m", turn=7)) for kind in bench.SCHEMA_KINDS}
    tools = bodies["schema_tools"]["tools"][0]["function"]["parameters"]
    assert tools == bodies["schema_messages"]["tools"][0]["input_schema"] == bench.RECURSIVE_SCHEMA
    assert bodies["schema_responses"]["text"]["format"]["schema"] == bench.RECURSIVE_SCHEMA
    assert len(bodies["schema_enum"]["response_format"]["json_schema"]["schema"]["enum"]) == 5000
    assert bench.schema_body("schema_fresh", "m", 8) != bench.schema_body("schema_fresh", "m", 7)
    assert all(body["model"] == "m" for body in bodies.values())
    with pytest.raises(ValueError, match="mix"):
        bench.FloodWorkload(mix="everything")


def test_the_envelope_must_be_the_surfaces_own():
    openai = json.dumps({"error": {"message": "too long", "type": "invalid_request_error",
                                   "code": "context_length_exceeded"}}).encode()
    anthropic = json.dumps({"type": "error", "error": {"type": "invalid_request_error",
                                                       "message": "too long"}}).encode()
    assert bench.envelope_ok("chat", 400, openai) and bench.envelope_ok("responses", 413, openai)
    assert bench.envelope_ok("messages", 400, anthropic)
    assert not bench.envelope_ok("messages", 400, openai)  # OpenAI's shape on Messages
    assert not bench.envelope_ok("chat", 500, openai) and not bench.envelope_ok("chat", 400, b"<html>")


def test_a_tiny_flood_against_the_live_gateway(gateway):
    workload = bench.FloodWorkload(duration_s=1.0, baseline_s=0.5, flood_processes=1, senders=2,
                                   body_bytes=MIB, message_chars=64 * 1024, mix="bodies")
    figures = bench.run_flood(gateway.open_url, gateway.model, workload, os.getpid(),
                             ready_s=1.5, settle_s=0.2)
    flood = figures["flood"]
    assert flood["requests"] >= 2 and figures["byte_bound"], figures
    assert set(flood["statuses_by_kind"]) <= set(bench.KINDS)
    assert flood["server_errors"] == flood["bad_envelopes"] == flood["transport_errors"] == 0, flood
    assert all(400 <= int(status) < 500 for counts in flood["statuses_by_kind"].values()
               for status in counts), flood
    for name in ("health", "small_chat"):
        assert figures[name]["count"] >= 1 and figures[name]["p99_s"] is not None
        assert figures["baseline"][name]["count"] >= 1
    assert figures["probe_errors"] == 0, figures["first_probe_error"]
    assert set(figures["rss_mb"]) == {"before", "peak", "after", "high_water", "with_workers_peak"}
    assert not bench.failed(figures) and isinstance(bench.target_met(figures), bool)
