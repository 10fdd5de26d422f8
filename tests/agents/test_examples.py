"""The framework examples run as scripts against an OpenAI-compatible server (the fake one)."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow  # starts a server

EXAMPLES = Path(__file__).resolve().parents[2] / "agents" / "examples"


def run_example(name: str, url: str) -> str:
    result = subprocess.run([sys.executable, str(EXAMPLES / name), "--base-url", f"{url}/ok/v1",
                             "--agent-id", "example-1"], capture_output=True, text=True,
                            timeout=120)
    assert result.returncode == 0, result.stderr
    return result.stdout


def test_examples_do_not_import_our_agents_package():
    # The OpenAI Agents SDK is also imported as `agents`; examples must stay independent.
    for path in EXAMPLES.glob("*.py"):
        source = path.read_text()
        assert "import agents" not in source and "from agents" not in source, path.name


def test_openai_sdk_agent_runs_a_tool_loop(fake_server):
    fake_server.reset()
    out = run_example("openai_sdk_agent.py", fake_server.url)
    assert "step 0: prompt_tokens=" in out and "step 1:" in out and "cached_tokens=0" in out
    first, second = fake_server.log
    assert first["agent"] == first["user"] == "example-1"
    tool_message = second["body"]["messages"][-1]
    assert tool_message["role"] == "tool" and tool_message["tool_call_id"] == "call_0"
    assert "p99_ms" in tool_message["content"]


@pytest.mark.skipif(importlib.util.find_spec("langchain_openai") is None,
                    reason="langchain-openai is not installed (dev extra)")
def test_langchain_agent_runs_a_tool_loop(fake_server):
    fake_server.reset()
    out = run_example("langchain_agent.py", fake_server.url)
    assert "step 1: cached prompt tokens = 0" in out
    first, second = fake_server.log
    assert first["agent"] == first["user"] == "example-1"
    assert second["body"]["messages"][-1] == {"role": "tool", "tool_call_id": "call_0",
                                               "content": "41"}
