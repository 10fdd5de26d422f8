"""A small OpenAI-compatible server that misbehaves on request, on a free loopback port.

The first path segment picks the behaviour: ``{base}/{mode}/v1/chat/completions`` and
``{base}/{mode}/tokenize``.

- ``ok``: (non-streamed: a chat.completion that calls the first tool, then answers) a proper
  SSE stream with usage and ``cached_tokens`` (the longest common prefix with the
  same agent's previous prompt, in 16-token blocks: a per-session cache, always <= the ideal);
  ``/tokenize`` returns the UTF-8 bytes of a ChatML-like rendering as "token ids".
  ``GET /v1/models`` lists "fake-model" (the other modes have no model list).
- ``nocache``: like ok, without ``prompt_tokens_details`` and without ``/tokenize`` (404).
- ``error500``: HTTP 500 with an OpenAI error envelope.
- ``badsse``: 200 with a non-JSON ``data:`` line; ``badshape``: JSON of the wrong shape.
- ``hangup``: one good chunk, then the connection drops mid-body.
- ``hang``: never answers (the client times out).
- ``mixed``: cycles ok, error500, badsse, hangup, truncated (no ``[DONE]``) per request.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import socket
import threading
import time
from collections.abc import Iterator

import pytest
import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse

PAGE = 16


def render(messages: list[dict]) -> list[int]:
    """The fake tokenizer: bytes of a ChatML-like rendering plus the generation prompt."""
    turns = (f"<|{m['role']}|>{m.get('content') or ''}<|end|>" for m in messages)
    text = "".join(turns) + "<|assistant|>"
    return list(text.encode())


def make_app(log: list[dict], last_prompt: dict[str, list[int]]) -> FastAPI:
    """The app; ``log`` collects every chat request, ``last_prompt`` is the per-agent cache."""
    app = FastAPI()
    counter = itertools.count()

    @app.get("/{mode}/v1/models")
    async def models(mode: str):
        if mode != "ok":
            return JSONResponse({"detail": "Not Found"}, status_code=404)
        return {"object": "list", "data": [{"id": "fake-model", "object": "model"}]}

    @app.post("/{mode}/tokenize")
    async def tokenize(mode: str, request: Request):
        if mode == "nocache":
            return JSONResponse({"detail": "Not Found"}, status_code=404)
        tokens = render((await request.json())["messages"])
        return {"tokens": tokens, "count": len(tokens), "max_model_len": 1 << 20}

    @app.post("/{mode}/v1/chat/completions")
    async def chat(mode: str, request: Request):
        body = await request.json()
        agent = request.headers.get("x-agent-id")
        log.append({"mode": mode, "agent": agent, "user": body.get("user"),
                    "auth": request.headers.get("authorization"), "body": body})
        if mode == "mixed":
            mode = ("ok", "error500", "badsse", "hangup", "truncated")[next(counter) % 5]
        if mode == "hang":
            await asyncio.sleep(30)
        if mode == "error500":
            return JSONResponse({"error": {"message": "engine exploded", "type": "server_error",
                                           "code": 500}}, status_code=500)
        prompt = render(body["messages"])
        previous = last_prompt.get(agent, [])
        last_prompt[agent] = prompt
        shared = next((i for i, (a, b) in enumerate(zip(prompt, previous, strict=False))
                       if a != b), min(len(prompt), len(previous)))
        cached = min(shared, len(prompt) - 1) // PAGE * PAGE
        limit = body.get("max_tokens") or body.get("max_completion_tokens") or 8
        words = [f" w{i}" for i in range(min(limit, 8))]
        if not body.get("stream"):
            return completion(body, prompt, words)

        def chunk(delta: dict, finish: str | None = None) -> str:
            choice = {"index": 0, "delta": delta, "finish_reason": finish}
            return "data: " + json.dumps({"object": "chat.completion.chunk",
                                          "choices": [choice]}) + "\n\n"

        def events() -> Iterator[str]:
            yield chunk({"role": "assistant", "content": ""})
            if mode == "badsse":
                yield "data: {this is not json\n\n"
            if mode == "badshape":
                yield 'data: {"choices": "not a list"}\n\n'
            for i, word in enumerate(words):
                yield chunk({"content": word})
                time.sleep(0.001)
                if mode == "hangup" and i == 0:
                    raise RuntimeError("fake server hangs up mid-stream")
            yield chunk({}, "length")
            usage = {"prompt_tokens": len(prompt), "completion_tokens": len(words),
                     "total_tokens": len(prompt) + len(words)}
            if mode != "nocache":
                usage["prompt_tokens_details"] = {"cached_tokens": cached}
            yield "data: " + json.dumps({"choices": [], "usage": usage}) + "\n\n"
            if mode != "truncated":
                yield "data: [DONE]\n\n"

        return StreamingResponse(events(), media_type="text/event-stream")

    return app


def completion(body: dict, prompt: list[int], words: list[str]) -> dict:
    """A non-streamed reply: a call of the first tool until a tool result is in the history
    (arguments: each required parameter set to "eu"), then text."""
    tools = body.get("tools") or []
    message: dict = {"role": "assistant", "content": "".join(words)}
    if tools and not any(m["role"] == "tool" for m in body["messages"]):
        function = tools[0]["function"]
        arguments = {name: "eu" for name in function["parameters"].get("required", [])}
        message = {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_0", "type": "function",
             "function": {"name": function["name"], "arguments": json.dumps(arguments)}}]}
    usage = {"prompt_tokens": len(prompt), "completion_tokens": len(words),
             "total_tokens": len(prompt) + len(words),
             "prompt_tokens_details": {"cached_tokens": 0}}
    return {"id": "chatcmpl-0", "object": "chat.completion", "created": 0,
            "model": body["model"], "usage": usage,
            "choices": [{"index": 0, "message": message,
                         "finish_reason": "tool_calls" if message.get("tool_calls") else "length"}]}


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class FakeServer:
    def __init__(self) -> None:
        self.log: list[dict] = []
        self.last_prompt: dict[str, list[int]] = {}
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{self.sock.getsockname()[1]}"
        # asyncio's loop, as the gateway pins it: uvicorn's "auto" would pick uvloop, which
        # ray[serve] installs
        config = uvicorn.Config(make_app(self.log, self.last_prompt), log_level="critical",
                                timeout_graceful_shutdown=1, loop="asyncio")
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self.sock]},
                                       daemon=True)

    def __enter__(self) -> FakeServer:
        self.thread.start()
        deadline = time.monotonic() + 30
        while not self.server.started:
            if time.monotonic() > deadline or not self.thread.is_alive():
                raise RuntimeError("fake OpenAI server did not start")
            time.sleep(0.01)
        return self

    def reset(self) -> None:
        """Forget earlier requests (the log and the per-agent cache), as a fresh server would."""
        self.log.clear()
        self.last_prompt.clear()

    def __exit__(self, *exc: object) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=10)
        self.sock.close()


@pytest.fixture(scope="session")
def fake_server() -> Iterator[FakeServer]:
    with FakeServer() as server:
        yield server
