"""benchmarks.api_fuzz: the hook that keeps a case cheap, the envelope check, the settings and
the report (its run against the live gateway is tests/gateway/test_api_fuzz.py)."""

from collections import Counter

import pytest

from benchmarks import api_fuzz as bench


def test_generation_is_cut_short_and_only_what_costs_decoding_changes():
    body = {"model": "gpt-x", "max_tokens": 4000, "max_completion_tokens": 3080.0, "n": 16,
            "prompt": ["a"] * 9, "messages": [{"role": "user", "content": "hi"}]}
    cut = bench.bounded_body("/v1/chat/completions", body, "served", 2)
    assert cut == {"model": "served", "max_tokens": 2, "max_completion_tokens": 2, "n": 2,
                   "prompt": ["a"] * 4, "messages": body["messages"]}
    assert body["max_tokens"] == 4000  # the drawn body is left as it was
    # absent or null means "the rest of the context": the first limit is set either way
    assert bench.bounded_body("/v1/messages", {}, None, 2) == {"max_tokens": 2}
    assert bench.bounded_body("/v1/responses", {"max_output_tokens": None}, None, 2) == {
        "max_output_tokens": 2}
    # what the server must refuse stays: wrong types, negatives, booleans, token-id prompts
    for value in (-5, 0, "many", True, [7]):
        assert bench.bounded_body("/v1/completions", {"max_tokens": value}, None, 2) == {
            "max_tokens": value}
    ids = list(range(9))
    assert bench.bounded_body("/v1/completions", {"prompt": ids, "max_tokens": 1}, None, 2)[
        "prompt"] == ids
    # tools (and a namespace's functions) are prompt to prefill: at most 4
    tools = [{"type": "namespace", "tools": [{"name": f"f{i}"} for i in range(9)]}] * 9
    cut = bench.bounded_body("/v1/responses", {"tools": tools}, None, 2)["tools"]
    assert len(cut) == 4 and all(len(t["tools"]) == 4 for t in cut)
    # routes that do not generate are sent as drawn
    assert bench.bounded_body("/tokenize", {"model": "x"}, "served", 2) == {"model": "x"}


def test_the_envelope_must_be_the_surfaces_own():
    openai = b'{"error": {"message": "bad", "type": "invalid_request_error"}}'
    anthropic = b'{"type": "error", "error": {"type": "invalid_request_error", "message": "bad"}}'
    assert bench.envelope_ok("/v1/chat/completions", 400, openai)
    assert bench.envelope_ok("/v1/messages/count_tokens", 404, anthropic)
    assert not bench.envelope_ok("/v1/messages", 400, openai)
    assert not bench.envelope_ok("/v1/responses", 500, openai)
    assert not bench.envelope_ok("/v1/responses", 400, b"<html>")
    assert bench.stream_failed("text/event-stream", 'data: {"error": {"type": "internal_error"}}')
    assert not bench.stream_failed("application/json", '"internal_error"')


def test_settings_are_checked():
    for bad in ({"max_examples": 0}, {"modes": ("sideways",)}, {"modes": ()},
                {"max_new_tokens": 0}):
        with pytest.raises(ValueError):
            bench.FuzzSettings(**bad)


def test_the_report_names_each_operation_and_its_failures(capsys):
    ok = bench.OperationFigures("POST /v1/messages", "positive", cases=3,
                                statuses=Counter({200: 2, 400: 1}), seconds=1.5)
    bad = bench.OperationFigures("POST /v1/responses", "negative", cases=2,
                                 statuses=Counter({500: 1, 400: 1}), server_errors=1,
                                 first_failure="curl ...\n-> 500 boom")
    bench.print_report([ok, bad])
    out = capsys.readouterr().out
    assert "POST /v1/messages" in out and "200:2 400:1" in out
    assert "5 cases" in out and "5xx 1" in out and "-> 500 boom" in out
    assert (ok.failures, bad.failures) == (0, 1)
    assert bench.totals([ok, bad])["server_errors"] == 1
    assert bench.as_json([bad])[0]["statuses"] == {"500": 1, "400": 1}
