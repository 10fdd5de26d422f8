"""Qwen3.5 (Qwen3-Coder's XML calls, a ``<think>`` span its generation prompt opens) through
the live gateway on the tiny hybrid model with its real tokenizer and template, and the
official SDKs: forced calls on every surface, whole and streamed, checked against the tool's
schema; ``tool_choice: none``; the think span as reasoning on chat, Responses and Messages;
the reasoning controls reaching the template. Random weights: calls and spans are forced by
grammars, or the output is whatever the model writes inside the span the prompt opened."""

from __future__ import annotations

import anthropic
import openai
import pytest

from tests.gateway.tools.family_server import (
    CHAT_TOOLS,
    MAX_TOKENS,
    SCHEMA,
    USER,
    check_call,
    family_server,
    forced_calls_on_responses_and_messages,
    forced_chat_calls,
    tool_loop_hit,
)

MODEL = "tiny-qwen3.5"
PAGE_SIZE = 16
# the prompt opened the span: the grammar writes the rest of it, then the answer
THINK = 'root ::= "The user wants a greeting.\\n</think>\\n\\nHello"'
OFF = {"chat_template_kwargs": {"enable_thinking": False}}
GREEDY = {"temperature": 0}  # (this anthropic SDK's create() takes no temperature)


@pytest.fixture(scope="module")
def base_url():
    with family_server("qwen3_5", {"served_model_name": MODEL}) as (url,):
        yield url


@pytest.fixture(scope="module")
def oai(base_url):
    return openai.OpenAI(base_url=base_url + "/v1", api_key="unused", max_retries=0)


@pytest.fixture(scope="module")
def claude(base_url):
    return anthropic.Anthropic(base_url=base_url, api_key="unused", max_retries=0)


def test_forced_chat_calls_parse_whole_and_streamed(oai):
    # (a named function: the Messages stream below and tool_loop_hit's first turn)
    forced_chat_calls(oai, MODEL, "required")


def test_forced_calls_on_responses_and_messages(oai, claude):
    forced_calls_on_responses_and_messages(oai, claude, MODEL)


def test_a_forced_call_closes_the_opened_span_first(oai):
    """With thinking on the prompt ends ``<think>\\n``: the forced call is written after an
    empty span (as the template re-renders it), not inside the span as reasoning."""
    done = oai.chat.completions.create(model=MODEL, messages=USER, tools=CHAT_TOOLS,
                                       tool_choice="required", max_tokens=120, temperature=0,
                                       parallel_tool_calls=False)
    message = done.choices[0].message
    assert message.tool_calls and not (message.content or "").strip()
    assert getattr(message, "reasoning_content", None) in (None, "")  # an empty span
    none = oai.chat.completions.create(model=MODEL, messages=USER, tools=CHAT_TOOLS,
                                       tool_choice="none", max_tokens=8, temperature=0)
    assert not none.choices[0].message.tool_calls


def test_auto_and_a_streamed_responses_call(oai):
    # auto: free text (here the random model's reasoning) until a call, which must be valid
    auto = oai.chat.completions.create(model=MODEL, messages=USER, tools=CHAT_TOOLS,
                                       tool_choice="auto", max_tokens=8, temperature=0)
    for call in auto.choices[0].message.tool_calls or ():
        check_call(call.function.name, call.function.arguments)
    tools = [{"type": "function", "name": "get_weather", "parameters": SCHEMA}]
    done = None
    for event in oai.responses.create(model=MODEL, input=USER[0]["content"], tools=tools,
                                      tool_choice="required", parallel_tool_calls=False,
                                      max_output_tokens=MAX_TOKENS, temperature=0, stream=True):
        if event.type == "response.completed":
            done = event.response
    assert done is not None
    (call,) = [item for item in done.output if item.type == "function_call"]
    check_call(call.name, call.arguments)


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


def test_the_opened_span_is_reasoning_on_responses_and_messages(oai, claude):
    """Thinking on: what the model writes after the prompt's ``<think>\\n`` is reasoning (a
    Responses reasoning item, an Anthropic thinking block), whole and streamed; thinking off:
    the answer."""
    response = oai.responses.create(model=MODEL, input="hi", max_output_tokens=8,
                                    temperature=0)
    assert response.output[0].type == "reasoning"
    text = "".join(c.text for c in response.output[0].content)
    assert text and not response.output_text  # (the message item is empty)
    streamed = ""
    for event in oai.responses.create(model=MODEL, input="hi", max_output_tokens=8,
                                      temperature=0, stream=True):
        if event.type == "response.reasoning_text.delta":
            streamed += event.delta
        assert event.type != "response.output_text.delta"
    assert streamed == text
    off = oai.responses.create(model=MODEL, input="hi", max_output_tokens=8, temperature=0,
                               reasoning={"effort": "none"})
    assert "reasoning" not in [item.type for item in off.output] and off.output_text
    hi = [{"role": "user", "content": "hi"}]
    message = claude.messages.create(model=MODEL, max_tokens=8, messages=hi, extra_body=GREEDY)
    assert [b.type for b in message.content] == ["thinking"]
    with claude.messages.stream(model=MODEL, max_tokens=8, messages=hi,
                                extra_body=GREEDY) as stream:
        final = stream.get_final_message()
    assert [b.type for b in final.content] == ["thinking"]
    assert final.content[0].thinking == message.content[0].thinking
    off = claude.messages.create(model=MODEL, max_tokens=8, messages=hi, extra_body=GREEDY,
                                 thinking={"type": "disabled"})
    assert [b.type for b in off.content] == ["text"]


def test_reasoning_controls_reach_the_template(oai, claude):
    # thinking off, the template closes an empty span in the prompt
    def chat_prompt(**extra) -> int:
        done = oai.chat.completions.create(model=MODEL, messages=USER, max_tokens=1,
                                           extra_body=extra)
        return done.usage.prompt_tokens

    thinking, plain = chat_prompt(), chat_prompt(**OFF)
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
