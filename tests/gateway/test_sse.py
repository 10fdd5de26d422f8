"""Raw SSE framing over httpx: ``data: <json>\\n\\n`` events, the usage event, ``data: [DONE]``."""

from __future__ import annotations

import json

import pytest

pytestmark = pytest.mark.slow


def raw_events(client, path: str, body: dict) -> tuple[object, str]:
    with client.stream("POST", path, json=body) as response:
        text = response.read().decode()
    return response, text


def parse(text: str) -> list[str]:
    """Split an SSE body into event payloads, checking the framing byte for byte."""
    assert text.endswith("\n\n"), "every event ends with a blank line"
    events = text.split("\n\n")[:-1]
    payloads = []
    for event in events:
        assert event.startswith("data: "), f"not a data event: {event!r}"
        assert "\n" not in event, "one line per event (JSON has no raw newlines)"
        payloads.append(event[len("data: ") :])
    return payloads


def test_chat_stream_framing_with_usage(client, gateway):
    response, text = raw_events(
        client,
        "/v1/chat/completions",
        {
            "model": gateway.model,
            "messages": [{"role": "user", "content": "Hello there"}],
            "max_tokens": 4,
            "stream": True,
            "stream_options": {"include_usage": True},
        },
    )
    assert response.status_code == 200
    assert response.headers["content-type"].startswith("text/event-stream")
    assert response.headers["cache-control"] == "no-cache"
    payloads = parse(text)
    assert payloads[-1] == "[DONE]"
    chunks = [json.loads(p) for p in payloads[:-1]]
    assert all(c["object"] == "chat.completion.chunk" for c in chunks)
    assert chunks[0]["choices"][0]["delta"]["role"] == "assistant"
    # include_usage: every chunk has a usage key, null except on the last one
    assert all(c["usage"] is None for c in chunks[:-1])
    last = chunks[-1]
    assert last["choices"] == []
    usage = last["usage"]
    assert usage["total_tokens"] == usage["prompt_tokens"] + usage["completion_tokens"]
    assert isinstance(usage["prompt_tokens_details"]["cached_tokens"], int)
    finish = [
        c["choices"][0]["finish_reason"] for c in chunks[:-1] if c["choices"][0]["finish_reason"]
    ]
    assert len(finish) == 1


def test_stream_without_include_usage_has_no_usage_key(client, gateway):
    response, text = raw_events(
        client,
        "/v1/completions",
        {"model": gateway.model, "prompt": "A B C", "max_tokens": 3, "stream": True},
    )
    payloads = parse(text)
    assert payloads[-1] == "[DONE]"
    chunks = [json.loads(p) for p in payloads[:-1]]
    assert chunks and all("usage" not in c for c in chunks)
    assert all(c["object"] == "text_completion" for c in chunks)


def test_stream_errors_before_the_first_byte_are_http_errors(client, gateway):
    response = client.post(
        "/v1/chat/completions",
        json={
            "model": gateway.model,
            "messages": [{"role": "user", "content": "x"}],
            "max_tokens": gateway.max_model_len + 1,
            "stream": True,
        },
    )
    assert response.status_code == 400
    assert response.json()["error"]["code"] == "context_length_exceeded"


def test_a_body_that_never_started_is_still_released():
    """A client gone before the first byte: the body generator never ran (so none of its
    ``finally`` will), and ``on_close`` releases what it holds (the engine requests)."""
    import asyncio

    from starlette.requests import ClientDisconnect

    from prefixgate.gateway.server.sse import SSEResponse

    ran, released = [], []

    async def body():
        try:
            yield b"data: {}\n\n"
        finally:
            ran.append(True)

    async def release() -> None:
        released.append(True)

    async def gone(message) -> None:
        raise OSError("the client closed the connection")

    async def receive():
        return {"type": "http.disconnect"}

    response = SSEResponse(body(), on_close=release)
    scope = {"type": "http", "asgi": {"spec_version": "2.4"}}
    with pytest.raises(ClientDisconnect):
        asyncio.run(response(scope, receive, gone))
    assert released == [True] and ran == []
