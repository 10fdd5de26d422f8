"""Qwen3 (Hermes ``<tool_call>`` + ``<think>``) through the live gateway and the official SDKs:
its own template renders the tools, the grammar forces calls in its format, every surface
parses them into the same call, ``<think>`` is reasoning, and the request's reasoning controls
reach the template (tiny random weights: calls and think spans are forced by grammars)."""

from __future__ import annotations

import anthropic
import httpx
import openai
import pytest

from tests.gateway.tools.family_server import (
    CHAT_TOOLS,
    NAMED,
    USER,
    family_server,
    forced_calls_on_responses_and_messages,
    forced_chat_calls,
    tool_loop_hit,
)

MODEL = "tiny-qwen3"
THINK = 'root ::= "<think>\\nThe user wants a greeting.\\n</think>\\n\\nHello"'
PAGE_SIZE = 16


@pytest.fixture(scope="module")
def base_url():
    with family_server("qwen3", {"served_model_name": MODEL}) as (url,):
        yield url


@pytest.fixture(scope="module")
def oai(base_url):
    return openai.OpenAI(base_url=base_url + "/v1", api_key="unused", max_retries=0)


@pytest.fixture(scope="module")
def claude(base_url):
    return anthropic.Anthropic(base_url=base_url, api_key="unused", max_retries=0)


def test_the_template_renders_the_tools(base_url):
    with httpx.Client(base_url=base_url) as client:
        ids = client.post("/tokenize", json={"messages": USER, "tools": CHAT_TOOLS}).json()
        text = client.post("/detokenize", json={"tokens": ids["tokens"]}).json()["prompt"]
    assert "<tools>" in text and "# Tools\n\nYou may call" in text  # Qwen3's own wording
    assert "described by JSON schemas inside" not in text  # not the gateway's prompt


@pytest.mark.parametrize("choice", ["required", NAMED])
def test_forced_chat_calls_parse_whole_and_streamed(oai, choice):
    forced_chat_calls(oai, MODEL, choice)


def test_forced_calls_on_responses_and_messages(oai, claude):
    forced_calls_on_responses_and_messages(oai, claude, MODEL)


def test_the_history_with_calls_extends_the_first_prompt(oai):
    cached, first = tool_loop_hit(oai, MODEL)
    assert cached >= first // PAGE_SIZE * PAGE_SIZE


def test_a_think_span_is_reasoning_content(oai):
    grammar = {"type": "grammar", "grammar": THINK}
    hi = [{"role": "user", "content": "hi"}]
    done = oai.chat.completions.create(model=MODEL, messages=hi, max_tokens=60,
                                       extra_body={"response_format": grammar})
    message = done.choices[0].message
    assert message.content == "Hello"
    assert message.reasoning_content.strip() == "The user wants a greeting."
    reasoning, content = "", ""
    for chunk in oai.chat.completions.create(model=MODEL, messages=hi, max_tokens=60,
                                             stream=True, extra_body={"response_format": grammar}):
        if chunk.choices:
            reasoning += getattr(chunk.choices[0].delta, "reasoning_content", None) or ""
            content += chunk.choices[0].delta.content or ""
    assert (reasoning, content) == (message.reasoning_content, "Hello")


def test_reasoning_controls_reach_the_template(oai, claude):
    # Qwen3's template closes an empty think span in the prompt when thinking is off
    def chat_prompt(**extra) -> int:
        done = oai.chat.completions.create(model=MODEL, messages=USER, max_tokens=1,
                                           extra_body=extra)
        return done.usage.prompt_tokens

    thinking, plain = chat_prompt(), chat_prompt(chat_template_kwargs={"enable_thinking": False})
    assert plain > thinking
    assert chat_prompt(reasoning_effort="none") == plain
    assert chat_prompt(reasoning_effort="high") == thinking
    response = oai.responses.create(model=MODEL, input=USER[0]["content"], max_output_tokens=16,
                                    reasoning={"effort": "none"})
    assert response.usage.input_tokens == plain
    message = claude.messages.create(model=MODEL, max_tokens=1, messages=USER,
                                     thinking={"type": "disabled"})
    usage = message.usage
    assert usage.input_tokens + usage.cache_read_input_tokens + \
        usage.cache_creation_input_tokens == plain
    with pytest.raises(openai.BadRequestError, match="chat_template_kwargs"):
        chat_prompt(chat_template_kwargs={"bos_token": "<|im_start|>system"})
