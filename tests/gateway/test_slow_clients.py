"""Slow and greedy clients (#15, section 4): body-size cap (413), header and body deadlines
(408 / close), the connection cap (503), on live uvicorn servers with tight limits over the
shared engine. A storm of idle and half-sent sockets must not delay a normal request."""

from __future__ import annotations

import json
import socket
import time
from collections.abc import Iterator
from dataclasses import dataclass

import httpx
import pytest

from prefixgate.gateway.http.limits import ConnectionLimits
from prefixgate.gateway.http.slow_clients import (
    JSON_ESCAPE_BYTES,
    NON_PROMPT_BYTES,
    ONE_PROMPT_ROUTES,
    prompt_body_caps,
)
from prefixgate.gateway.server import ServerSettings, create_app
from prefixgate.gateway.server.launch import GatewayServer, ServersThread, uvicorn_config

HEADER_TIMEOUT_S = 1.5
BODY_TIMEOUT_S = 1.5
MAX_BODY = 64 * 1024
STORM_CAP = 200  # above the storm: idle sockets must not cost a normal request its slot
SMALL_CAP = 8


@dataclass(frozen=True)
class Servers:
    storm_url: str  # generous connection cap, tight timeouts and body cap
    capped_url: str  # SMALL_CAP connections
    model: str


def _limits(max_connections: int) -> ConnectionLimits:
    return ConnectionLimits(
        header_timeout_s=HEADER_TIMEOUT_S,
        body_timeout_s=BODY_TIMEOUT_S,
        keep_alive_timeout_s=1.0,
        max_connections=max_connections,
        max_body_bytes=MAX_BODY,
    )


@pytest.fixture(scope="module")
def servers(engine, gateway) -> Iterator[Servers]:
    # `gateway` keeps the shared engine running (and owns its lifecycle); these servers only
    # add apps with tight limits over it, on their own event loop.
    built = []
    for cap in (STORM_CAP, SMALL_CAP):
        settings = ServerSettings(host="127.0.0.1", port=0, log_level="error", limits=_limits(cap))
        app = create_app(engine, settings, manage_engine=False)
        built.append(GatewayServer(uvicorn_config(app, settings), engine, settings))
    thread = ServersThread(built, name="prefixgate-test-slow-clients")
    thread.start_and_wait()
    try:
        yield Servers(built[0].base_url, built[1].base_url, gateway.model)
    finally:
        thread.stop()


def _address(url: str) -> tuple[str, int]:
    host, port = url.removeprefix("http://").rsplit(":", 1)
    return host, int(port)


def _connect(url: str) -> socket.socket:
    sock = socket.create_connection(_address(url), timeout=10)
    sock.settimeout(10)
    return sock


def _read_response(sock: socket.socket) -> tuple[int, dict[str, str], bytes]:
    """Read until the server closes; parse status, headers and body (b'' = closed silently)."""
    data = b""
    while True:
        chunk = sock.recv(65536)
        if not chunk:
            break
        data += chunk
    if not data:
        return 0, {}, b""
    head, _, body = data.partition(b"\r\n\r\n")
    lines = head.decode("latin-1").split("\r\n")
    status = int(lines[0].split()[1])
    headers = {k.strip().lower(): v.strip() for k, v in (ln.split(":", 1) for ln in lines[1:])}
    return status, headers, body


def _chat(model: str, **extra) -> dict:
    return {"model": model, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4,
            "temperature": 0, **extra}


def _head(path: str, extra: str) -> bytes:
    return (f"POST {path} HTTP/1.1\r\nHost: test\r\nContent-Type: application/json\r\n"
            f"{extra}\r\n").encode()


def test_body_over_cap_by_content_length_is_413_before_reading(servers):
    with _connect(servers.storm_url) as sock:
        # No body follows: the answer must come from the declared length alone.
        sock.sendall(_head("/v1/chat/completions", f"Content-Length: {MAX_BODY + 1}\r\n"))
        status, headers, body = _read_response(sock)
    assert status == 413
    assert headers["connection"] == "close"
    error = json.loads(body)["error"]
    assert error["type"] == "invalid_request_error"
    assert error["code"] == "request_too_large"
    assert str(MAX_BODY) in error["message"]


def test_anthropic_route_answers_413_in_its_envelope(servers):
    with _connect(servers.storm_url) as sock:
        sock.sendall(_head("/v1/messages", f"Content-Length: {MAX_BODY * 10}\r\n"))
        status, _, body = _read_response(sock)
    assert status == 413
    assert json.loads(body) == {"type": "error", "error": {
        "type": "request_too_large", "message": json.loads(body)["error"]["message"]}}


def test_chunked_body_over_cap_is_counted_and_413(servers):
    chunk = b"x" * 4096
    with _connect(servers.storm_url) as sock:
        sock.sendall(_head("/v1/chat/completions", "Transfer-Encoding: chunked\r\n"))
        # Just over the cap: small enough that the server reads it all (no reset on close).
        for _ in range(MAX_BODY // len(chunk) + 1):
            sock.sendall(b"%x\r\n%s\r\n" % (len(chunk), chunk))
        status, _, body = _read_response(sock)
    assert status == 413
    assert json.loads(body)["error"]["code"] == "request_too_large"


def test_body_just_under_cap_is_served(servers):
    body = json.dumps(_chat(servers.model)).encode()
    body += b" " * (MAX_BODY - len(body))  # JSON allows trailing whitespace: exactly the cap
    response = httpx.post(servers.storm_url + "/v1/chat/completions", content=body,
                          headers={"Content-Type": "application/json"}, timeout=60)
    assert response.status_code == 200, response.text


def test_half_sent_body_gets_408_after_the_body_timeout(servers):
    with _connect(servers.storm_url) as sock:
        sock.sendall(_head("/v1/chat/completions", "Content-Length: 100\r\n") + b'{"model":')
        started = time.monotonic()
        status, headers, body = _read_response(sock)
    assert status == 408
    assert json.loads(body)["error"]["code"] == "request_timeout"
    assert BODY_TIMEOUT_S * 0.9 <= time.monotonic() - started < BODY_TIMEOUT_S + 5


def test_storm_of_idle_and_half_sent_sockets_does_not_delay_a_normal_request(servers):
    partials = [
        b"",  # connected, silent
        b"POST /v1/chat/comp",  # half a request line
        b"POST /v1/chat/completions HTTP/1.1\r\nHost: test\r\nContent-Ty",  # half the headers
        _head("/v1/chat/completions", "Content-Length: 5000\r\n") + b'{"mo',  # half a body
    ]
    storm = []
    try:
        for i in range(40):
            sock = _connect(servers.storm_url)
            if partials[i % 4]:
                sock.sendall(partials[i % 4])
            storm.append((i % 4, sock))
        opened = time.monotonic()
        with httpx.Client(base_url=servers.storm_url, timeout=60) as client:
            started = time.monotonic()
            assert client.get("/v1/models").status_code == 200
            # Well inside the read timeout: nobody waited for the storm.
            assert time.monotonic() - started < HEADER_TIMEOUT_S
            completion = client.post("/v1/chat/completions", json=_chat(servers.model))
            assert completion.status_code == 200, completion.text
            assert completion.json()["choices"][0]["message"]["content"] is not None
        # Every storm socket is closed by the server after its deadline.
        for kind, sock in storm:
            status, _, body = _read_response(sock)
            if kind == 0:
                assert (status, body) == (0, b"")  # an idle socket just closes
            else:
                assert status == 408, (kind, status, body)
                assert json.loads(body)["error"]["code"] == "request_timeout"
        assert time.monotonic() - opened < max(HEADER_TIMEOUT_S, BODY_TIMEOUT_S) + 8
    finally:
        for _, sock in storm:
            sock.close()


def test_trickled_headers_do_not_extend_the_deadline(servers):
    with _connect(servers.storm_url) as sock:
        started = time.monotonic()
        sock.sendall(b"GET /v1/models HTTP/1.1\r\n")
        closed_early = False
        for i in range(int(HEADER_TIMEOUT_S * 4) + 8):  # one header line every 0.25 s
            time.sleep(0.25)
            try:
                sock.sendall(b"X-Slow-%d: 1\r\n" % i)
            except OSError:
                closed_early = True
                break
        elapsed = time.monotonic() - started
        if not closed_early:
            status, _, _ = _read_response(sock)
            assert status == 408
    assert elapsed < HEADER_TIMEOUT_S + 3


def test_stream_outlives_every_timeout(servers):
    # A stream longer than the header, body and keep-alive timeouts is never cut.
    payload = _chat(servers.model, stream=True, max_tokens=48, ignore_eos=True)
    started = time.monotonic()
    events = []
    with (
        httpx.Client(base_url=servers.storm_url, timeout=60) as client,
        client.stream("POST", "/v1/chat/completions", json=payload) as response,
    ):
        assert response.status_code == 200
        for line in response.iter_lines():
            if line.startswith("data: "):
                events.append(line[6:])
                if len(events) < 4:
                    time.sleep(0.6)  # a slow reader: the stream outlasts the deadlines
    assert events[-1] == "[DONE]"
    assert time.monotonic() - started > max(HEADER_TIMEOUT_S, BODY_TIMEOUT_S)


def test_over_the_connection_cap_is_503_not_a_hang(servers):
    idle = [_connect(servers.capped_url) for _ in range(SMALL_CAP)]
    try:
        time.sleep(0.2)  # the server has accepted them all
        response = httpx.get(servers.capped_url + "/v1/models", timeout=10)
        assert response.status_code == 503
        assert response.headers["retry-after"] == "1"
        assert response.json()["error"]["code"] == "too_many_connections"
    finally:
        for sock in idle:
            sock.close()
    deadline = time.monotonic() + 10
    while True:  # the server notices the closes at once; poll only to bound a failure
        response = httpx.get(servers.capped_url + "/v1/models", timeout=10)
        if response.status_code == 200 or time.monotonic() > deadline:
            break
        time.sleep(0.05)
    assert response.status_code == 200


def test_a_one_prompt_body_the_context_cannot_hold_is_413_before_reading(gateway):
    """Under the 32 MiB --max-body-size, a chat / Messages body over what a prompt that fits
    the context can take (JSON-escaped) plus the other fields is refused by its declared
    length, in the surface's envelope: a flood of maximal bodies is never read or parsed."""
    declared = 32 * 1024 * 1024 - 1
    for path in ("/v1/chat/completions", "/v1/messages"):
        with _connect(gateway.open_url) as sock:
            sock.sendall(_head(path, f"Content-Length: {declared}\r\n"))  # no body follows
            status, _, body = _read_response(sock)
        assert status == 413, (path, body)
        error = json.loads(body)["error"]
        assert "fits the context" in error["message"]
        assert (error["type"] if path == "/v1/messages" else error["code"]) == "request_too_large"


def test_prompt_body_caps_cover_the_one_prompt_routes_only():
    caps = prompt_body_caps(8192, 81)
    assert caps["/v1/chat/completions"][0] == 8192 * 81 * JSON_ESCAPE_BYTES + NON_PROMPT_BYTES
    assert set(caps) == set(ONE_PROMPT_ROUTES)
    assert "/v1/completions" not in caps  # up to MAX_PROMPTS prompts: --max-body-size alone
    assert prompt_body_caps(8192, None) == {}  # no provable byte bound: no caps
