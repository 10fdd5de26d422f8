"""The real coding CLIs, headless, against a live gateway on the default model stretched past
its trained context (``--rope-scaling yarn:4``), with only the set-up a user would do
(docs/clients.md): Claude Code (``claude -p`` then ``claude -p --continue``) and Codex
(``codex exec``, ``wire_api = "responses"``).

The CLIs come from npm (pinned versions) into a cached folder (``~/.cache/prefixgate/npm-clients``,
or PREFIXGATE_NPM_CLIENTS_DIR): installed once, reused offline. Without npm the tests skip.

Cost on 2 CPU cores: a prompt is prefilled at tens of tokens a second, so Claude Code runs with
``--tools Bash,Read`` (its own default system prompt for those tools; ~2.8k tokens) instead of
all 25 default tools (~23k tokens with this tokenizer, many minutes of prefill here); set
PREFIXGATE_TEST_CLAUDE_TOOLS=default for the full default. With only those tools Claude Code
sends neither its mid-conversation system message (it comes with the Agent tool) nor a
description over 8,192 characters (Workflow's is 18,780), so a third test records its two
full-default turns from the real CLI (against a stand-in API) and has the gateway count them
and the router hash them: no prefill. Codex runs with its defaults (~9.2k tokens). The gateway samples greedily (``--default-temperature 0``) so the runs are repeatable.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import httpx
import pytest

from prefixgate.engine.config import EngineConfig
from prefixgate.gateway.server import ServerSettings
from tests.live_gateway import live_servers

pytestmark = pytest.mark.slow

CLAUDE_CODE = "@anthropic-ai/claude-code@2.1.197"
CODEX = "@openai/codex@0.171.0"
ALIASES = ("claude-*", "gpt-5*")
CLAUDE_TOOLS = os.environ.get("PREFIXGATE_TEST_CLAUDE_TOOLS", "Bash,Read")
FULL_DEFAULT = CLAUDE_TOOLS == "default"
# the full default's cold ~23k-token prefill can take longer than Claude Code's own request
# timeout (API_TIMEOUT_MS, 10 minutes) on a loaded CPU: that run raises both
CLI_TIMEOUT_S = 3600 if FULL_DEFAULT else 900


def _npm_dir() -> Path:
    default = Path.home() / ".cache" / "prefixgate" / "npm-clients"
    return Path(os.environ.get("PREFIXGATE_NPM_CLIENTS_DIR") or default)


def _installed(folder: Path, spec: str) -> bool:
    name, _, version = spec.rpartition("@")
    package = folder / "node_modules" / name / "package.json"
    return package.is_file() and json.loads(package.read_text()).get("version") == version


@pytest.fixture(scope="module")
def npm_bin() -> Path:
    """The CLIs' bin folder, installed from npm on first use (idempotent, then offline)."""
    if shutil.which("npm") is None:
        pytest.skip("npm is not installed: the Claude Code and Codex CLI tests need it")
    folder = _npm_dir()
    missing = [spec for spec in (CLAUDE_CODE, CODEX) if not _installed(folder, spec)]
    if missing:
        folder.mkdir(parents=True, exist_ok=True)
        subprocess.run(["npm", "install", "--prefix", str(folder), "--no-audit", "--no-fund",
                        "--no-save", *missing], check=True, timeout=600,
                       stdout=subprocess.DEVNULL)
    return folder / "node_modules" / ".bin"


@pytest.fixture(scope="module")
def gateway_url(loaded_model) -> Iterator[str]:
    from prefixgate.engine.async_engine import build_engine

    # 1,024 pages x 16 = 16k tokens: Codex's ~9.2k-token prompt and Claude Code's turns;
    # 2,048 (32k) for Claude Code's full default (~23k tokens)
    engine = build_engine(EngineConfig(num_pages=2048 if FULL_DEFAULT else 1024, page_size=16,
                                       rope_scaling="yarn:4"), loaded=loaded_model)
    settings = ServerSettings(host="127.0.0.1", port=0, log_level="warning",
                              model_aliases=ALIASES, default_max_tokens=64,
                              default_temperature=0.0)
    with live_servers(engine, [settings]) as (server,):
        yield server.base_url


def _stats(url: str) -> dict:
    return httpx.get(url + "/v1/cache/stats", timeout=30).json()


def _run(args: list[str], env: dict[str, str], cwd: Path) -> tuple[subprocess.CompletedProcess, float]:
    start = time.monotonic()
    done = subprocess.run(args, env=env, cwd=cwd, capture_output=True, text=True,
                          timeout=CLI_TIMEOUT_S, stdin=subprocess.DEVNULL)
    return done, time.monotonic() - start


def _user_env(home: Path, **extra: str) -> dict[str, str]:
    # a clean user: PATH (node), a fresh HOME, and what docs/clients.md says to set
    return {"PATH": os.environ["PATH"], "HOME": str(home), **extra}


def test_claude_code_two_turns_read_the_cache(npm_bin, gateway_url, tmp_path):
    slow = {"API_TIMEOUT_MS": str(CLI_TIMEOUT_S * 1000)} if FULL_DEFAULT else {}
    env = _user_env(tmp_path / "home", ANTHROPIC_BASE_URL=gateway_url,
                    ANTHROPIC_API_KEY="sk-dummy", **slow)
    work = tmp_path / "work"
    work.mkdir()
    results = []
    for prompt, more in (("What is 2+2?", []), ("And 3+3?", ["--continue"])):
        before = _stats(gateway_url)["global"]
        done, seconds = _run([str(npm_bin / "claude"), "-p", prompt, *more, "--tools", CLAUDE_TOOLS,
                              "--output-format", "json"], env, work)
        assert done.returncode == 0, (done.stdout[-2000:], done.stderr[-2000:])
        result = json.loads(done.stdout)
        assert not result["is_error"] and result["result"], result
        after = _stats(gateway_url)["global"]
        results.append((result["usage"], seconds, before, after))
        print(f"claude turn {len(results)}: {seconds:.1f} s, usage {result['usage']}")
    usage, _, before, after = results[1]
    prompt = (usage["input_tokens"] + usage["cache_creation_input_tokens"]
              + usage["cache_read_input_tokens"])
    assert usage["cache_read_input_tokens"] >= 0.9 * prompt, usage
    # the gateway's own counters agree: the second turn's prompt tokens were hits
    assert after["hit_tokens"] - before["hit_tokens"] >= usage["cache_read_input_tokens"]
    assert _stats(gateway_url)["clients"]["attribution_blocks_removed"] >= 2


def test_codex_exec_completes_with_its_default_tools(npm_bin, gateway_url, tmp_path):
    home = tmp_path / "codex-home"
    home.mkdir()
    (home / "config.toml").write_text(
        'model = "gpt-5.1-codex"\nmodel_provider = "prefixgate"\n\n'
        "[model_providers.prefixgate]\n"
        'name = "prefixgate"\n'
        f'base_url = "{gateway_url}/v1"\n'
        'wire_api = "responses"\n'
        'env_key = "PREFIXGATE_API_KEY"\n')
    env = _user_env(tmp_path / "home", CODEX_HOME=str(home), PREFIXGATE_API_KEY="sk-dummy")
    work = tmp_path / "work"
    work.mkdir()
    before = _stats(gateway_url)["clients"]["hosted_tools_dropped"]
    done, seconds = _run([str(npm_bin / "codex"), "exec", "--skip-git-repo-check",
                          "What is 2+2? Answer with one number."], env, work)
    print(f"codex exec: {seconds:.1f} s")
    assert done.returncode == 0, (done.stdout[-2000:], done.stderr[-2000:])
    assert done.stdout.strip(), done.stderr[-2000:]  # the final message
    assert _stats(gateway_url)["clients"]["hosted_tools_dropped"] > before  # its web_search


class _Recorder(BaseHTTPRequestHandler):
    """A stand-in Anthropic API that records each request body and answers "4", streamed,
    naming the model as the gateway does (its served model: Claude Code restores a Claude
    name it reads back on --continue, which drops "[1m]" and changes its system prompt)."""

    protocol_version = "HTTP/1.1"
    bodies: list[dict]
    served: str

    def do_POST(self) -> None:  # noqa: N802 (http.server's name)
        body = json.loads(self.rfile.read(int(self.headers["content-length"])))
        self.bodies.append(body)
        message = {"id": "msg_0", "type": "message", "role": "assistant", "content": [],
                   "model": self.served, "stop_reason": None, "stop_sequence": None,
                   "usage": {"input_tokens": 1, "output_tokens": 0}}
        events = [
            ("message_start", {"message": message}),
            ("content_block_start", {"index": 0, "content_block": {"type": "text", "text": ""}}),
            ("content_block_delta", {"index": 0, "delta": {"type": "text_delta", "text": "4"}}),
            ("content_block_stop", {"index": 0}),
            ("message_delta", {"delta": {"stop_reason": "end_turn", "stop_sequence": None},
                               "usage": {"output_tokens": 1}}),
            ("message_stop", {})]
        data = "".join(f"event: {name}\ndata: {json.dumps({'type': name, **fields})}\n\n"
                       for name, fields in events).encode()
        self.send_response(200)
        self.send_header("content-type", "text/event-stream")
        self.send_header("content-length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, *args) -> None:
        pass


def _record_default_turns(npm_bin: Path, tmp_path: Path, served: str) -> list[dict]:
    """Claude Code's two turns with ALL its defaults (25 tools), as it sends them."""
    handler = type("Recorder", (_Recorder,), {"bodies": [], "served": served})
    server = ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        env = _user_env(tmp_path / "home", ANTHROPIC_BASE_URL=f"http://127.0.0.1:{server.server_port}",
                        ANTHROPIC_API_KEY="sk-dummy")
        work = tmp_path / "work"
        work.mkdir()
        for more in ([], ["--continue"]):
            done, _ = _run([str(npm_bin / "claude"), "-p", "What is 2+2?", *more,
                            "--output-format", "json"], env, work)
            assert done.returncode == 0, (done.stdout[-2000:], done.stderr[-2000:])
    finally:
        server.shutdown()
        server.server_close()
    return [body for body in handler.bodies if body.get("tools")]  # not the title requests


def test_claude_codes_full_default_turns_are_accepted_and_extend(npm_bin, gateway_url, tmp_path,
                                                                 tokenizer):
    """The full default request (what the two-turn test above trims with --tools, to keep the
    prefill short on CPU): recorded from the real CLI, then counted by the gateway (validation,
    bounds, template; no prefill), and hashed as the router does: turn 2 reads turn 1's blocks."""
    from prefixgate.gateway.http.auth import KeyTable
    from prefixgate.gateway.router.prompt import MESSAGES_PATH, PromptHasher

    served = httpx.get(gateway_url + "/v1/models", timeout=30).json()["data"][0]["id"]
    first, second = _record_default_turns(npm_bin, tmp_path, served)
    assert [m["role"] for m in first["messages"]] == ["user", "system"]
    assert [m["role"] for m in second["messages"]] == ["user", "system", "assistant", "user"]
    assert max(len(t.get("description", "")) for t in first["tools"]) > 8192  # the old cap
    counts = []
    for body in (first, second):
        counted = httpx.post(gateway_url + "/v1/messages/count_tokens", json=body, timeout=300)
        assert counted.status_code == 200, counted.text[:2000]
        counts.append(counted.json()["input_tokens"])
    assert 10_000 < counts[0] < counts[1] < 32_768, counts
    hasher = PromptHasher(tokenizer, "default", 16, 0, KeyTable({}, None))
    keys = [hasher.key(MESSAGES_PATH, json.dumps(body).encode(), {}) for body in (first, second)]
    assert [key.num_tokens for key in keys] == counts  # the router hashes what the gateway counts
    chains = [key.chain for key in keys]
    shared = next((i for i, (a, b) in enumerate(zip(*chains, strict=False)) if a != b),
                  len(keys[0].chain))
    print(f"claude full default: {len(first['tools'])} tools, {len(json.dumps(first))} bytes, "
          f"{counts} tokens; turn 2 shares {shared * 16} tokens of turn 1's blocks")
    assert shared * 16 >= 0.9 * counts[1], (shared, counts)
