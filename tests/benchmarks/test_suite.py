"""benchmarks.suite: which commands each part runs, the summary table, bad arguments."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

from benchmarks import suite


def test_every_part_gets_the_peer_the_settings_and_its_quick_preset(tmp_path):
    peer = ["--peer", "vllm", "--peers-dir", "/p"]
    for part in suite.PARTS:
        commands = suite.part_commands(part, True, tmp_path, peer, "--max-num-batched-tokens 512",
                                       "lru,retention")
        last = commands[-1]
        assert last[-2:] == ["--json", str(tmp_path / f"{part}.json")]
        flags = " ".join(last)
        assert "--max-num-batched-tokens 512" in flags
        assert ("--peer vllm" in flags) == (part != "sessions")  # prefixgate-only part
        assert "--quick" in flags or "--agents 4" in flags or "--max-output 32" in flags
    generate, replay = suite.part_commands("agent_trace", False, tmp_path, [], "", "lru")
    assert generate[0] == "benchmarks.agent_trace" and replay[replay.index("--trace") + 1] == \
        generate[generate.index("--out") + 1]
    assert "--prefixgate-args" not in replay and "--quick" not in replay
    with pytest.raises(ValueError, match="unknown part"):
        suite.part_commands("nope", False, tmp_path, [], "", "")


def test_summary_table_shows_ratios_and_targets(capsys):
    servers = {"prefixgate": {"e2e_p50_s": 3.0, "prefill_tokens": 700, "wall_s": 100.0},
               "vllm": {"e2e_p50_s": 6.0, "prefill_tokens": 1000, "wall_s": 120.0}}
    results = {"parts": {"trace": {"workload": {"floor_s": 94.1}, "servers": servers},
                         "burst": {"error": "exit status 2"}}}
    suite.print_summary(results)
    out = capsys.readouterr().out
    line = next(row for row in out.splitlines() if "request E2E p50" in row)
    assert line.split()[-5:] == ["3", "6", "0.5", "<=", "0.6"]  # ours, theirs, ratio, target
    assert "floor 94.1" in out and "exit status 2" in out


def test_a_part_that_fails_is_reported_not_raised(tmp_path: Path):
    assert suite.run_part("swarm", [["benchmarks.serving", "--agents", "0"]], tmp_path) == {
        "error": "exit status 2"}
    (tmp_path / "trace.json").write_text(json.dumps({"servers": {}}))
    data = suite.run_part("trace", [["json.tool", "--help"]], tmp_path)
    assert data["servers"] == {} and data["part_wall_s"] > 0


def test_unknown_parts_are_a_usage_error():
    done = subprocess.run([sys.executable, "-m", "benchmarks.suite", "--parts", "trace,nope"],
                          capture_output=True, text=True, timeout=60, check=False)
    assert done.returncode == 2 and "unknown part(s) nope" in done.stderr
