"""The ``python -m prefixgate.agents.swarm`` CLI end to end against the fake server."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from prefixgate.agents.swarm import main

from .conftest import free_port

pytestmark = pytest.mark.slow  # starts a server

TINY = ["--groups", "2", "--agents-per-group", "2", "--turns", "2", "--system-tokens", "120",
        "--task-tokens", "30", "--followup-tokens", "30", "--max-tokens", "2", "--no-progress"]


def test_help_documents_every_flag():
    result = subprocess.run([sys.executable, "-m", "prefixgate.agents.swarm", "--help"], capture_output=True,
                            text=True, check=True)
    for flag in ("--url", "--api-key", "--model", "--compare", "--groups", "--agents-per-group",
                 "--turns", "--system-tokens", "--task-tokens", "--followup-tokens",
                 "--max-tokens", "--concurrency", "--arrival", "--interval", "--rate", "--seed",
                 "--page-size", "--json", "X-Agent-Id", "cached_tokens", "/tokenize", "unknown"):
        assert flag in result.stdout, flag


def test_compare_against_a_server_without_cached_tokens(fake_server, tmp_path, capsys):
    fake_server.reset()
    path = tmp_path / "swarm.json"
    code = main([*TINY, "--url", f"{fake_server.url}/ok", "--compare",
                 f"{fake_server.url}/nocache", "--rounds", "2", "--json", str(path)])
    assert code == 0
    out = capsys.readouterr().out
    assert "A advantage" in out and "not reported" in out and "unknown" in out
    document = json.loads(path.read_text())
    assert [run["label"] for run in document["runs"]] == ["A", "B", "A", "B"]  # alternating
    assert all(len(run["records"]) == 8 for run in document["runs"])
    a, b = document["summaries"]
    assert a["requests"] == b["requests"] == 16 and a["ok"] == b["ok"] == 16
    assert 0 < a["achieved_hit_rate"] <= a["ideal_block_hit_rate"]
    assert b["achieved_hit_rate"] is None and b["ideal_hit_rate"] is None
    assert set(document["comparison"]) == {"ttft_p50", "output_tokens_per_s", "e2e_p50"}
    assert document["config"]["groups"] == 2 and "api_key" not in json.dumps(document["config"])
    # The same requests went to both servers: identical first-turn prompts per round.
    first = {run["label"]: run["records"][0] for run in document["runs"][:2]}
    assert first["A"]["prompt_tokens"] == first["B"]["prompt_tokens"]


def test_unreachable_url_reports_errors_and_exits_nonzero(capsys):
    code = main([*TINY, "--url", f"http://127.0.0.1:{free_port()}"])
    assert code == 1
    assert "connect: 8" in capsys.readouterr().out


def test_bad_knob_is_a_clear_error(capsys):
    assert main([*TINY, "--groups", "0"]) == 2
    assert "groups must be >= 1" in capsys.readouterr().err
