"""``prefixgate serve`` end to end, as a user runs it: a subprocess that loads the real model,
logs one ready line with its URL, takes settings from flags AND ``PREFIXGATE_*`` variables,
and exits cleanly on Ctrl-C.

Its waiting queue is set to hold nothing (``PREFIXGATE_MAX_WAITING=0``), so every generation
request overflows it: a deterministic 429, without racing a load generator against the
scheduler.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import openai
import pytest

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[2]
READY = re.compile(r"prefixgate ready: (\S+) at (http://\S+)/v1 \(auth (on|off)")
KEY = "sk-cli"
TENANT = "cli-tenant"


@dataclass
class CliServer:
    process: subprocess.Popen
    lines: list[str] = field(default_factory=list)
    url: str | None = None
    model: str | None = None
    auth: str | None = None


def _pump(server: CliServer) -> None:
    assert server.process.stderr is not None
    for line in server.process.stderr:
        server.lines.append(line)
        match = READY.search(line)
        if match and server.url is None:
            server.model, server.url, server.auth = match.groups()


@pytest.fixture(scope="module")
def cli_server() -> Iterator[CliServer]:
    env = {
        **os.environ,
        "PREFIXGATE_MAX_WAITING": "0",
        "PREFIXGATE_NUM_PAGES": "16",
        "PREFIXGATE_SERVED_MODEL_NAME": "smol-cli",
    }
    process = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "prefixgate.gateway.cli",
            "serve",
            "--port",
            "0",
            "--api-key",
            f"{KEY}:{TENANT}",
        ],
        cwd=REPO,
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )
    server = CliServer(process)
    threading.Thread(target=_pump, args=(server,), daemon=True).start()
    deadline = time.monotonic() + 300
    while server.url is None and process.poll() is None and time.monotonic() < deadline:
        time.sleep(0.1)
    if server.url is None:
        process.kill()
        process.wait()
        pytest.fail("prefixgate serve never logged its ready line:\n" + "".join(server.lines[-40:]))
    try:
        yield server
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()


def test_ready_line_names_model_url_and_auth(cli_server):
    assert cli_server.model == "smol-cli"  # from PREFIXGATE_SERVED_MODEL_NAME
    assert cli_server.auth == "on"  # from --api-key
    assert re.fullmatch(r"http://127\.0\.0\.1:\d+", cli_server.url)  # --port 0: the bound port
    ready = [line for line in cli_server.lines if "prefixgate ready" in line]
    assert len(ready) == 1
    assert "16 KV pages" in ready[0]  # from PREFIXGATE_NUM_PAGES


def test_auth_from_flags(cli_server):
    with httpx.Client(base_url=cli_server.url) as c:
        assert c.get("/health").status_code == 200
        assert c.get("/v1/models").status_code == 401
        models = c.get("/v1/models", headers={"Authorization": f"Bearer {KEY}"})
        assert models.status_code == 200
        assert models.json()["data"][0]["id"] == "smol-cli"


def test_full_queue_is_429_with_retry_after(cli_server):
    headers = {"Authorization": f"Bearer {KEY}"}
    with httpx.Client(base_url=cli_server.url, headers=headers) as c:
        for path, body in (
            (
                "/v1/chat/completions",
                {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2},
            ),
            ("/v1/completions", {"prompt": "hi", "max_tokens": 2, "stream": True}),
        ):
            response = c.post(path, json=body)
            assert response.status_code == 429, response.text
            assert int(response.headers["retry-after"]) >= 1
            error = response.json()["error"]
            assert error["type"] == "rate_limit_error" and error["code"] == "overloaded"
            assert response.headers["x-request-id"]
    sdk = openai.OpenAI(base_url=cli_server.url + "/v1", api_key=KEY, max_retries=0)
    with pytest.raises(openai.RateLimitError):
        sdk.chat.completions.create(
            model="smol-cli", messages=[{"role": "user", "content": "hi"}], max_tokens=2
        )


def test_ctrl_c_exits_cleanly(cli_server):
    cli_server.process.send_signal(signal.SIGINT)
    assert cli_server.process.wait(timeout=60) == 0
