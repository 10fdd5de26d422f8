"""Llama 3.1 (its JSON ``{"name", "parameters"}`` calls, the ``ipython`` role) through the live
gateway and the official SDKs: the template renders the tools and the history, the grammar
forces calls in its format, every surface parses them into the same call; and
``--tool-call-format hermes`` on the same model gets the gateway's Hermes prompt and calls."""

from __future__ import annotations

import json

import anthropic
import httpx
import openai
import pytest

from tests.gateway.tools.family_server import (
    CHAT_TOOLS,
    NAMED,
    USER,
    check_call,
    family_server,
    forced_calls_on_responses_and_messages,
    forced_chat_calls,
    tool_loop_hit,
)

MODEL = "tiny-llama3"
PAGE_SIZE = 16
ARGS = {"unit": "celsius", "daily": True}
HISTORY = [*USER,
           {"role": "assistant", "content": None, "tool_calls": [{"id": "call_1", "type": "function",
            "function": {"name": "get_weather", "arguments": json.dumps(ARGS)}}]},
           {"role": "tool", "tool_call_id": "call_1", "content": "18 C, sunny"}]  # fmt: skip


@pytest.fixture(scope="module")
def urls():
    with family_server("llama3", {"served_model_name": MODEL},
                       {"served_model_name": MODEL, "tool_call_format": "hermes"}) as urls:
        yield urls


@pytest.fixture(scope="module")
def oai(urls):
    return openai.OpenAI(base_url=urls[0] + "/v1", api_key="unused", max_retries=0)


def _prompt_text(base_url: str, messages: list) -> str:
    with httpx.Client(base_url=base_url) as client:
        ids = client.post("/tokenize", json={"messages": messages, "tools": CHAT_TOOLS}).json()
        return client.post("/detokenize", json={"tokens": ids["tokens"]}).json()["prompt"]


def test_the_template_renders_the_tools_and_the_history(urls):
    text = _prompt_text(urls[0], HISTORY)
    assert "Given the following functions" in text  # Llama 3.1's own tool prompt
    assert '{"name": "get_weather", "parameters": {"unit": "celsius", "daily": true}}' in text
    assert "<|start_header_id|>ipython<|end_header_id|>\n\n\"18 C, sunny\"" in text
    assert "<tool_call>" not in text
    hermes = _prompt_text(urls[1], HISTORY)  # the override: the gateway writes Hermes
    assert '<tool_call>\n{"name": "get_weather", "arguments": {"unit": "celsius", "daily": true}}' \
        in hermes and "<tool_response>\n18 C, sunny\n</tool_response>" in hermes


@pytest.mark.parametrize("choice", ["required", NAMED])
def test_forced_chat_calls_parse_whole_and_streamed(oai, choice):
    forced_chat_calls(oai, MODEL, choice)


def test_forced_calls_on_responses_and_messages(oai, urls):
    claude = anthropic.Anthropic(base_url=urls[0], api_key="unused", max_retries=0)
    forced_calls_on_responses_and_messages(oai, claude, MODEL)


def test_the_history_with_calls_extends_the_first_prompt(oai):
    cached, first = tool_loop_hit(oai, MODEL)
    assert cached >= first // PAGE_SIZE * PAGE_SIZE


def test_the_hermes_override_forces_hermes_calls(urls):
    with httpx.Client(base_url=urls[1], timeout=60) as client:
        body = {"messages": USER, "tools": CHAT_TOOLS, "tool_choice": NAMED, "max_tokens": 120,
                "temperature": 0, "logprobs": True}
        done = client.post("/v1/chat/completions", json=body).json()
    (call,) = done["choices"][0]["message"]["tool_calls"]
    check_call(call["function"]["name"], call["function"]["arguments"])
    raw = "".join(t["token"] for t in done["choices"][0]["logprobs"]["content"])
    assert raw.startswith('<tool_call>\n{"name": "get_weather", "arguments": ')
