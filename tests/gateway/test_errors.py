"""Every error case maps to the OpenAI envelope with the right status."""

from __future__ import annotations

import asyncio
import json
import re

import httpx
import pytest
from fastapi import FastAPI

from prefixgate.gateway.http.request_id import RequestIdMiddleware

pytestmark = pytest.mark.slow


def envelope(response: httpx.Response) -> dict:
    body = response.json()
    assert set(body) == {"error"}
    error = body["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["message"]
    return error


def test_malformed_json_is_400(client):
    response = client.post(
        "/v1/chat/completions",
        content=b'{"messages": [',
        headers={"content-type": "application/json"},
    )
    assert response.status_code == 400
    error = envelope(response)
    assert error["type"] == "invalid_request_error"
    assert "JSON" in error["message"]
    assert response.headers["x-request-id"]


def test_body_that_is_not_a_json_object_is_400(client):
    for content, content_type in (
        (b"messages=x", "application/x-www-form-urlencoded"),
        (b"[1, 2]", "application/json"),
    ):
        response = client.post(
            "/v1/chat/completions", content=content, headers={"content-type": content_type}
        )
        assert response.status_code == 400
        assert "JSON object" in envelope(response)["message"]


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"messages": []}, "messages"),
        ({"messages": [{"role": "wizard", "content": "x"}]}, "messages[0].role"),
        ({"messages": [{"role": "user", "content": "x"}], "temperature": 5}, "temperature"),
        ({"messages": [{"role": "user", "content": "x"}], "max_tokens": 0}, "max_tokens"),
        ({"messages": [{"role": "user", "content": "x"}], "top_p": 0}, "top_p"),
        ({"messages": [{"role": "user", "content": "x"}], "n": 0}, "n"),
        (
            {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]},
            "messages[0].content",
        ),
        ({"messages": [{"role": "user"}]}, "messages[0]"),
        ({}, "messages"),
    ],
)
def test_invalid_field_is_400_naming_the_field(client, body, param):
    response = client.post("/v1/chat/completions", json=body)
    assert response.status_code == 400, response.text
    error = envelope(response)
    assert error["param"] == param
    assert param in error["message"]


def test_invalid_completion_prompt_is_400(client):
    for prompt in ([], [[1, 2], "x"], [-1, 2], 5):
        response = client.post("/v1/completions", json={"prompt": prompt, "max_tokens": 1})
        assert response.status_code == 400
        assert envelope(response)["param"] == "prompt"


def test_context_length_is_400_with_both_numbers(client, gateway):
    prompt_ids = client.post("/tokenize", json={"prompt": "hello world"}).json()["tokens"]
    max_tokens = gateway.max_model_len  # prompt + this cannot fit
    response = client.post(
        "/v1/completions", json={"prompt": "hello world", "max_tokens": max_tokens}
    )
    assert response.status_code == 400
    error = envelope(response)
    assert error["code"] == "context_length_exceeded"
    numbers = {int(n) for n in re.findall(r"\d+", error["message"])}
    assert len(prompt_ids) in numbers and max_tokens in numbers


def test_unknown_model_is_404(client):
    response = client.post(
        "/v1/chat/completions",
        json={"model": "gpt-17", "messages": [{"role": "user", "content": "x"}], "max_tokens": 1},
    )
    assert response.status_code == 404
    error = envelope(response)
    assert error["code"] == "model_not_found" and error["param"] == "model"
    assert "gpt-17" in error["message"]


def test_unknown_route_is_enveloped_404(client):
    response = client.get("/v1/nope")
    assert response.status_code == 404
    envelope(response)


def test_missing_and_wrong_key_are_401(gateway):
    with httpx.Client(base_url=gateway.auth_url) as c:
        body = {"messages": [{"role": "user", "content": "x"}], "max_tokens": 1}
        missing = c.post("/v1/chat/completions", json=body)
        assert missing.status_code == 401
        assert envelope(missing)["type"] == "authentication_error"
        wrong = c.post("/v1/chat/completions", json=body, headers={"Authorization": "Bearer nope"})
        assert wrong.status_code == 401
        assert envelope(wrong)["code"] == "invalid_api_key"
        malformed = c.post(
            "/v1/chat/completions", json=body, headers={"Authorization": "Basic abc"}
        )
        assert malformed.status_code == 401
        # health stays open for probes; metrics need the admin key (or --metrics-public on)
        assert c.get("/health").status_code == 200
        assert envelope(c.get("/metrics"))["type"] == "authentication_error"


def test_unknown_token_id_is_400(client):
    response = client.post("/v1/completions", json={"prompt": [10**9], "max_tokens": 1})
    assert response.status_code == 400
    envelope(response)


def test_internal_error_is_500_envelope_with_request_id(caplog):
    """The last line of defence, on its own: an app whose route crashes."""
    app = FastAPI()

    @app.get("/boom")
    async def boom():
        raise RuntimeError("kaboom")

    app.add_middleware(RequestIdMiddleware)

    async def call() -> httpx.Response:
        transport = httpx.ASGITransport(app=app, raise_app_exceptions=False)
        async with httpx.AsyncClient(transport=transport, base_url="http://test") as c:
            return await c.get("/boom")

    with caplog.at_level("ERROR", logger="prefixgate.server"):
        response = asyncio.run(call())
    assert response.status_code == 500
    error = envelope(response)
    request_id = response.headers["x-request-id"]
    assert error["type"] == "internal_error" and request_id in error["message"]
    assert "kaboom" not in json.dumps(error)  # internals stay in the log
    assert any(request_id in r.getMessage() for r in caplog.records)
