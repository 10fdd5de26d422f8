"""Harmony through the live gateway on the tiny random gpt-oss (tests/harmony_fixture.py: the
real o200k_harmony tokenizer and gpt-oss's template): a forced call is written in harmony's
syntax, the engine stops on ``<|call|>``, and every surface parses the call, whole and
streamed; no harmony marker reaches a client (the analysis channel is reasoning)."""

from __future__ import annotations

import json

import anthropic
import openai
import pytest

from prefixgate.engine.async_engine import build_engine
from prefixgate.engine.config import EngineConfig
from prefixgate.engine.loader import load_model
from prefixgate.gateway.server import ServerSettings
from tests.gateway.tools.family_server import (
    CHAT_TOOLS,
    USER,
    forced_calls_on_responses_and_messages,
    forced_chat_calls,
)
from tests.harmony_fixture import gpt_oss_tiny_dir
from tests.live_gateway import live_servers

MODEL = "tiny-gpt-oss"


@pytest.fixture(scope="module")
def base_url():
    engine = build_engine(EngineConfig(num_pages=64, page_size=16, device="cpu"),
                          loaded=load_model(gpt_oss_tiny_dir()))
    settings = ServerSettings(host="127.0.0.1", port=0, log_level="warning",
                              served_model_name=MODEL)
    with live_servers(engine, [settings]) as (server,):
        yield server.base_url


@pytest.fixture(scope="module")
def oai(base_url):
    return openai.OpenAI(base_url=base_url + "/v1", api_key="unused", max_retries=0)


def test_a_forced_chat_call_parses_whole_and_streamed(oai):
    forced_chat_calls(oai, MODEL, "required")  # (named: the Messages stream below)


def test_forced_calls_on_responses_and_messages(oai, base_url):
    claude = anthropic.Anthropic(base_url=base_url, api_key="unused", max_retries=0)
    forced_calls_on_responses_and_messages(oai, claude, MODEL)


def test_no_harmony_marker_reaches_the_client(oai):
    done = oai.chat.completions.create(model=MODEL, messages=USER, tools=CHAT_TOOLS,
                                       max_tokens=40, temperature=0)
    message = done.choices[0].message
    for text in (message.content or "", getattr(message, "reasoning_content", None) or ""):
        assert "<|channel|>" not in text and "<|message|>" not in text



ANSWER = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"],
          "additionalProperties": False}  # finite: a random model always closes it


def _answer(text: str | None) -> None:
    assert json.loads(text or "") in ({"ok": True}, {"ok": False})


@pytest.mark.parametrize("tools", [{}, {"tools": CHAT_TOOLS, "tool_choice": "none"}])
def test_a_json_answer_is_chat_content_whole_and_streamed(oai, tools):
    """response_format under ``none`` / without tools: the final channel, shown as content."""
    fmt = {"type": "json_schema", "json_schema": {"name": "answer", "schema": ANSWER}}
    args = {"model": MODEL, "messages": USER, "response_format": fmt, "max_tokens": 40,
            "temperature": 0, **tools}
    done = oai.chat.completions.create(**args)
    message = done.choices[0].message
    _answer(message.content)
    assert not message.tool_calls and done.choices[0].finish_reason == "stop"
    chunks = list(oai.chat.completions.create(**args, stream=True))
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) \
        == message.content


def test_a_json_answer_is_content_on_responses_and_messages(oai, base_url):
    text = {"format": {"type": "json_schema", "name": "answer", "schema": ANSWER}}
    args = {"model": MODEL, "input": "Weather in Paris?", "text": text,
            "max_output_tokens": 40, "temperature": 0}
    done = oai.responses.create(**args)
    _answer(done.output_text)
    events = list(oai.responses.create(**args, stream=True))
    assert "".join(e.delta for e in events if e.type == "response.output_text.delta") \
        == done.output_text
    claude = anthropic.Anthropic(base_url=base_url, api_key="unused", max_retries=0)
    # (this SDK's create takes no temperature: the body carries it)
    fmt = {"output_config": {"format": {"type": "json_schema", "schema": ANSWER}},
           "temperature": 0}
    reply = claude.messages.create(model=MODEL, max_tokens=40, messages=USER, extra_body=fmt)
    (block,) = reply.content
    _answer(block.text)
    with claude.messages.stream(model=MODEL, max_tokens=40, messages=USER,
                                extra_body=fmt) as stream:
        assert stream.get_final_text() == block.text


def test_tool_choice_none_makes_no_call_on_any_surface(oai, base_url):
    done = oai.chat.completions.create(model=MODEL, messages=USER, tools=CHAT_TOOLS,
                                       tool_choice="none", max_tokens=30, temperature=0)
    assert not done.choices[0].message.tool_calls
    assert "<|channel|>" not in (done.choices[0].message.content or "")
    response = oai.responses.create(
        model=MODEL, input="Weather in Paris?", tool_choice="none", max_output_tokens=30,
        tools=[{"type": "function", **CHAT_TOOLS[0]["function"]}], temperature=0)
    assert not [item for item in response.output if item.type == "function_call"]
    claude = anthropic.Anthropic(base_url=base_url, api_key="unused", max_retries=0)
    tools = [{"name": "get_weather", "description": "The weather forecast",
              "input_schema": CHAT_TOOLS[0]["function"]["parameters"]}]
    reply = claude.messages.create(model=MODEL, max_tokens=30, messages=USER, tools=tools,
                                   tool_choice={"type": "none"}, extra_body={"temperature": 0})
    assert not [block for block in reply.content if block.type == "tool_use"]
