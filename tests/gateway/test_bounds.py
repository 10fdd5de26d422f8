"""Every bound of the request models, at its edge: just inside is accepted, just outside is a
400 in the error envelope whose ``param`` names the field (as the route spells it)."""

from __future__ import annotations

import httpx
import pytest

from prefixgate.gateway.server import fields as p
from prefixgate.gateway.server.openai.schemas import (
    ChatCompletionRequest,
    CompletionRequest,
    TokenizeRequest,
)

pytestmark = pytest.mark.slow

MSG = [{"role": "user", "content": "hi"}]


def envelope(response: httpx.Response) -> dict:
    assert response.status_code == 400, (response.status_code, response.text[:300])
    body = response.json()
    assert set(body) == {"error"} and set(body["error"]) == {"message", "type", "param", "code"}
    assert body["error"]["type"] == "invalid_request_error" and body["error"]["message"]
    return body["error"]


def msgs(n: int) -> list[dict]:
    return [{"role": "user", "content": "hi"}] * n


def tools(n: int) -> list[dict]:
    return [{"type": "function", "function": {"name": f"f{i}"}} for i in range(n)]


# (field as `param` names it, fields inside the bound, the same fields just outside)
CHAT_BOUNDS = [
    ("n", {"n": p.MAX_N}, {"n": p.MAX_N + 1}),
    ("top_k", {"top_k": -1}, {"top_k": -2}),
    ("top_k", {"top_k": p.MAX_TOKEN_ID}, {"top_k": p.MAX_TOKEN_ID + 1}),
    ("seed", {"seed": 2**63 - 1}, {"seed": 2**63}),
    ("seed", {"seed": -(2**63)}, {"seed": -(2**63) - 1}),
    ("max_tokens", {"max_tokens": 1}, {"max_tokens": 0}),
    ("max_tokens", {"max_tokens": p.MAX_TOKEN_ID}, {"max_tokens": p.MAX_TOKEN_ID + 1}),
    ("max_completion_tokens", {"max_completion_tokens": p.MAX_TOKEN_ID},
     {"max_completion_tokens": p.MAX_TOKEN_ID + 1}),
    ("top_logprobs", {"logprobs": True, "top_logprobs": 20}, {"logprobs": True, "top_logprobs": 21}),
    ("stop", {"stop": ["x"] * p.MAX_STOP_STRINGS}, {"stop": ["x"] * (p.MAX_STOP_STRINGS + 1)}),
    ("stop", {"stop": "x" * p.MAX_STOP_CHARS}, {"stop": "x" * (p.MAX_STOP_CHARS + 1)}),
    ("stop_token_ids", {"stop_token_ids": [1] * p.MAX_STOP_TOKEN_IDS},
     {"stop_token_ids": [1] * (p.MAX_STOP_TOKEN_IDS + 1)}),
    ("stop_token_ids[0]", {"stop_token_ids": [0]}, {"stop_token_ids": [-1]}),
    ("temperature", {"temperature": 2.0}, {"temperature": 2.0001}),
    ("presence_penalty", {"presence_penalty": -2.0}, {"presence_penalty": -2.0001}),
    ("frequency_penalty", {"frequency_penalty": 2.0}, {"frequency_penalty": 2.0001}),
    ("repetition_penalty", {"repetition_penalty": 10.0}, {"repetition_penalty": 10.0001}),
    ("min_p", {"min_p": 1.0}, {"min_p": 1.0001}),
    ("top_p", {"top_p": 1.0}, {"top_p": 1.0001}),
    ("user", {"user": "u" * p.MAX_LABEL_CHARS}, {"user": "u" * (p.MAX_LABEL_CHARS + 1)}),
    ("cache_salt", {"cache_salt": "s" * p.MAX_LABEL_CHARS}, {"cache_salt": "s" * (p.MAX_LABEL_CHARS + 1)}),
    ("messages", {"messages": msgs(p.MAX_MESSAGES)}, {"messages": msgs(p.MAX_MESSAGES + 1)}),
    ("messages[0].content", {"messages": [{"role": "user", "content": "x" * p.MAX_TEXT_CHARS}]},
     {"messages": [{"role": "user", "content": "x" * (p.MAX_TEXT_CHARS + 1)}]}),
    ("messages[0].content",
     {"messages": [{"role": "user", "content": [{"type": "text", "text": "x"}] * p.MAX_CONTENT_PARTS}]},
     {"messages": [{"role": "user", "content": [{"type": "text", "text": "x"}] * (p.MAX_CONTENT_PARTS + 1)}]}),
    ("messages[0].name", {"messages": [{"role": "user", "content": "x", "name": "n" * p.MAX_LABEL_CHARS}]},
     {"messages": [{"role": "user", "content": "x", "name": "n" * (p.MAX_LABEL_CHARS + 1)}]}),
    ("tools", {"tools": tools(p.MAX_TOOLS)}, {"tools": tools(p.MAX_TOOLS + 1)}),
]
COMPLETION_BOUNDS = [
    ("logprobs", {"logprobs": 5}, {"logprobs": 6}),
    ("prompt", {"prompt": ["a"] * p.MAX_PROMPTS}, {"prompt": ["a"] * (p.MAX_PROMPTS + 1)}),
    ("prompt", {"prompt": "x" * p.MAX_TEXT_CHARS}, {"prompt": "x" * (p.MAX_TEXT_CHARS + 1)}),
    ("prompt", {"prompt": [p.MAX_TOKEN_ID]}, {"prompt": [p.MAX_TOKEN_ID + 1]}),
    ("seed", {"seed": 2**63 - 1}, {"seed": 2**63}),
    ("top_k", {"top_k": p.MAX_TOKEN_ID}, {"top_k": p.MAX_TOKEN_ID + 1}),
]


@pytest.mark.parametrize(("param", "inside", "outside"), CHAT_BOUNDS, ids=lambda v: str(v)[:40])
def test_chat_bounds(client, param, inside, outside):
    ChatCompletionRequest.model_validate({"messages": MSG, **inside})  # just inside: accepted
    error = envelope(client.post("/v1/chat/completions", json={"messages": MSG, **outside}))
    assert error["param"] == param, error


@pytest.mark.parametrize(("param", "inside", "outside"), COMPLETION_BOUNDS, ids=lambda v: str(v)[:40])
def test_completion_bounds(client, param, inside, outside):
    CompletionRequest.model_validate({"prompt": "hi", **inside})
    error = envelope(client.post("/v1/completions", json={"prompt": "hi", **outside}))
    assert error["param"] == param, error


def test_tokenize_bounds(client):
    TokenizeRequest.model_validate({"messages": msgs(p.MAX_MESSAGES)})
    assert envelope(client.post("/tokenize", json={"messages": msgs(p.MAX_MESSAGES + 1)}))["param"] == "messages"
    assert envelope(client.post("/tokenize", json={"prompt": "x" * (p.MAX_TEXT_CHARS + 1)}))["param"] == "prompt"
    error = envelope(client.post("/detokenize", json={"tokens": [0] * (p.MAX_PROMPT_TOKENS + 1)}))
    assert error["param"] == "tokens"


def test_engine_bounds_at_the_edge(client, engine):
    """Bounds that depend on the model: top_k <= vocabulary size, stop ids in the vocabulary,
    prompt + max_tokens <= context (named ``prompt`` on /v1/completions)."""
    vocab = engine.core.runner.vocab_size
    ok = client.post("/v1/chat/completions", json={"messages": MSG, "max_tokens": 1, "top_k": vocab,
                                                   "temperature": 1.0, "stop_token_ids": [vocab - 1]})
    assert ok.status_code == 200, ok.text
    error = envelope(client.post("/v1/chat/completions", json={"messages": MSG, "max_tokens": 1,
                                                               "top_k": vocab + 1}))
    assert error["param"] == "top_k" and str(vocab) in error["message"]
    # the poison: a top_k past int64 is a 400 naming top_k, not a 500 for everyone
    assert envelope(client.post("/v1/completions", json={"prompt": "hi", "top_k": 2**63}))["param"] == "top_k"
    error = envelope(client.post("/v1/completions", json={"prompt": "hi", "stop_token_ids": [vocab]}))
    assert error["param"] == "stop_token_ids"
    # (just inside needs a full-context prefill: the context check is covered in test_errors.py)
    limit = min(engine.max_model_len, engine.core.scheduler.cache.num_pages * engine.page_size)
    error = envelope(client.post("/v1/completions", json={"prompt": [1] * limit, "max_tokens": 1}))
    assert error["param"] == "prompt" and error["code"] == "context_length_exceeded"
    error = envelope(client.post("/v1/chat/completions", json={"messages": MSG, "max_tokens": limit}))
    assert error["param"] == "messages" and error["code"] == "context_length_exceeded"
