"""benchmarks.trace: the streamed-chunk folding, the figures, the server checks, and tiny
replays (closed and open loop) against the live test gateway."""

import asyncio
import json
from pathlib import Path

import pytest

from benchmarks import trace as bench
from benchmarks import trace_workload as tw


def test_fold_reads_text_finish_reason_usage_and_errors():
    outcome = bench.Outcome(0, 0, 0)
    assert bench._fold({"choices": [{"text": "a", "finish_reason": None}]}, outcome)
    assert not bench._fold({"choices": [{"text": "", "finish_reason": "length"}]}, outcome)
    usage = {"prompt_tokens": 40, "completion_tokens": 3,
             "prompt_tokens_details": {"cached_tokens": 32}}
    assert not bench._fold({"choices": [], "usage": usage}, outcome)
    assert (outcome.prompt_tokens, outcome.completion_tokens, outcome.cached_tokens,
            outcome.finish_reason) == (40, 3, 32, "length")
    with pytest.raises(ValueError, match="stream error: boom"):
        bench._fold({"error": {"message": "boom"}}, outcome)


def _outcome(id_, session, turn, sent, ttft, done, prompt, cached, itl=()):
    return bench.Outcome(id_, session, turn, sent, done, ttft, list(itl), prompt, cached, 4)


def test_summarise_splits_first_and_returning_turns():
    outcomes = [_outcome(0, 0, 0, 0.0, 2.0, 3.0, 100, 0, [0.1, 0.3]),
                _outcome(1, 1, 0, 1.0, 4.0, 5.0, 100, 0),
                _outcome(2, 0, 1, 5.0, 0.5, 6.0, 200, 96, [0.2]),
                bench.Outcome(3, 1, 1, 6.0, 6.5, error="HTTP 500: no")]
    figures = bench.summarise(outcomes, wall_s=10.0)
    assert (figures["requests"], figures["ok"], figures["errors"]) == (4, 3, 1)
    assert figures["first_error"] == "HTTP 500: no"
    assert figures["ttft_first_p50_s"] == 3.0 and figures["ttft_returning_p50_s"] == 0.5
    assert figures["e2e_sum_s"] == 3.0 + 4.0 + 1.0 and figures["e2e_p50_s"] == 3.0
    assert figures["itl_p50_s"] == pytest.approx(0.2)
    # session 0: sent at 0, last done at 6; session 1: its ok request 1.0 -> 5.0
    assert figures["session_p50_s"] == pytest.approx(5.0)
    assert (figures["prompt_tokens"], figures["cached_tokens"], figures["prefill_tokens"]) == (
        400, 96, 304)
    assert figures["hit_rate"] == pytest.approx(0.24)


def test_ratios_are_prefixgate_over_peer():
    ours = {"ok": 1, "wall_s": 50.0, "prefill_tokens": 700, "hit_rate": 0.6}
    theirs = {"ok": 1, "wall_s": 100.0, "prefill_tokens": 1000, "hit_rate": 0.3}
    out = bench.ratios(ours, theirs)
    assert (out["wall_ratio"], out["prefill_tokens_ratio"], out["hit_rate_ratio"]) == (0.5, 0.7, 2.0)
    assert out["ttft_p50_ratio"] is None
    assert all(v is None for v in bench.ratios(ours, None).values())
    assert all(v is None for v in bench.ratios(ours, {**theirs, "ok": 0}).values())


def test_server_checks_come_before_anything_starts(tmp_path):
    assert bench.check_servers(bench.Servers()) is None
    missing = bench.check_servers(bench.Servers(peer="vllm", peers_dir=tmp_path))
    assert "not installed" in missing and "vllm_cpu.sh" in missing
    serve = tmp_path / "vllm" / "serve.sh"
    serve.parent.mkdir()
    serve.write_text("#!/bin/sh\n")
    serve.chmod(0o755)
    assert bench.check_servers(bench.Servers(peer="vllm", peers_dir=tmp_path)) is None
    assert "whole GiB" in bench.check_servers(
        bench.Servers(kv_memory=0.5, peer="vllm", peers_dir=tmp_path))
    assert "no shared prefix" in bench.check_servers(bench.Servers(peer="llama-server"))


def test_bad_flags_and_a_bad_trace_end_in_a_usage_error(tmp_path, capsys):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"timestamp": 0}\n')
    for argv in (["--trace", str(bad)], ["--scale", "5"], ["--trace", str(tmp_path / "none")]):
        with pytest.raises(SystemExit) as exit_info:
            bench.main(argv)
        assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert "line 1: KeyError" in err and "must divide" in err and "No such file" in err


@pytest.mark.skipif(not bench.DEFAULT_TRACE.exists(), reason="the shared public trace is absent")
def test_quick_preset_fills_only_what_the_flags_left(tmp_path):
    parser = bench.base_parser("t")
    bench.add_workload_arguments(parser)
    selection, scaling = bench.workload_from_args(parser.parse_args(["--quick", "--sessions", "3"]))
    assert (selection.sessions, selection.max_turns) == (3, bench.QUICK["max_turns"])
    assert scaling.time_scale == bench.QUICK["time_scale"]
    replay, workload = bench.build_from_args(parser.parse_args(["--quick"]))
    assert workload["sessions"] == bench.QUICK["sessions"] and len(replay) == workload["requests"]
    assert workload["longest_request_tokens"] < 8192  # fits the default model's context


TINY_TRACE = [  # two sessions of two turns; the second turn extends the first's blocks
    {"timestamp": 0, "input_length": 5120, "output_length": 3, "hash_ids": list(range(10))},
    {"timestamp": 0, "input_length": 5120, "output_length": 3, "hash_ids": list(range(10, 20))},
    {"timestamp": 1000, "input_length": 5632, "output_length": 3, "hash_ids": [*range(10), 20]},
    {"timestamp": 1500, "input_length": 5632, "output_length": 3,
     "hash_ids": [*range(10, 20), 21]},
]


def _tiny_replay(tmp_path: Path) -> list[tw.ReplayRequest]:
    """Two sessions, two turns each, a few output tokens, short pauses (a trace in the public
    one's format written here, so the test needs nothing outside the checkout)."""
    path = tmp_path / "tiny.jsonl"
    path.write_text("".join(json.dumps(line) + "\n" for line in TINY_TRACE))
    requests = tw.load_trace(path)
    links = tw.link_sessions(requests)
    positions = tw.select(requests, links, tw.Selection(sessions=2, max_turns=2))
    scaling = tw.Scaling(scale=128, max_output=3, time_scale=0.002)  # 4-token blocks
    return tw.build_replay(requests, links, positions, scaling)


@pytest.mark.parametrize("mode", ["closed", "open"])
def test_replay_against_the_live_gateway(gateway, mode, tmp_path: Path):
    replay = _tiny_replay(tmp_path)
    assert [r.turn for r in replay].count(1) >= 2
    wall_s, outcomes = asyncio.run(bench.replay_requests(gateway.open_url, gateway.model,
                                                         replay, mode, timeout_s=120))
    assert [o.error for o in outcomes] == [None] * len(replay)
    assert all(o.completion_tokens == r.max_tokens and o.prompt_tokens == len(r.prompt)
               for o, r in zip(outcomes, replay, strict=True))  # ignore_eos, token-id prompts
    by_id = {o.id: o for o in outcomes}
    for request in replay:
        outcome = by_id[request.id]
        if request.parent is None or mode == "open":
            assert outcome.sent_s >= request.at_s - 0.01  # never early
        else:  # closed loop: its pause starts when its parent finished
            assert outcome.sent_s >= by_id[request.parent].done_s + request.gap_s - 0.01
        if request.parent is not None and mode == "closed":  # its parent's blocks are cached
            common = next((n for n, (a, b) in enumerate(
                zip(replay[request.parent].prompt, request.prompt, strict=False)) if a != b),
                len(replay[request.parent].prompt))
            assert outcome.cached_tokens >= common // gateway.page_size * gateway.page_size > 0
    figures = bench.summarise(outcomes, wall_s)
    assert figures["ttft_returning_p50_s"] is not None and figures["ok"] == len(replay)


def test_run_server_reports_a_quick_replay(gateway, tmp_path: Path):
    replay = _tiny_replay(tmp_path)[:2]
    summary = bench.run_server("prefixgate", gateway.open_url, gateway.model, replay, "open", 120)
    assert summary["ok"] == 2 and summary["warmup_error"] is None
    assert summary["cache_stats"] is not None and len(summary["outcomes"]) == 2
