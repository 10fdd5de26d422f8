"""Mistral Nemo's ``[TOOL_CALLS][{"name", "arguments", "id"}]`` list through the live gateway:
its real template (the sdist has no Nemo tokenizer: the tiny Llama 3 model's stands in) renders
the tools and the history, the grammar forces calls in its list, ids included, and every
surface parses them into the same call; tool_choice none writes no call."""

from __future__ import annotations

import re

import anthropic
import openai
import pytest

from tests.family_fixtures import template
from tests.gateway.tools.family_server import (
    CHAT_TOOLS,
    MAX_TOKENS,
    NAMED,
    USER,
    family_server,
    forced_calls_on_responses_and_messages,
    forced_chat_calls,
    tool_loop_hit,
)

MODEL = "tiny-mistral-nemo"
PAGE_SIZE = 16


@pytest.fixture(scope="module")
def base_url():
    nemo = template("mistralai-Mistral-Nemo-Instruct-2407.jinja")
    with family_server("llama3", {"served_model_name": MODEL}, template=nemo) as (url,):
        yield url


@pytest.fixture(scope="module")
def oai(base_url):
    return openai.OpenAI(base_url=base_url + "/v1", api_key="unused", max_retries=0)


@pytest.mark.parametrize("choice", ["required", NAMED])
def test_forced_chat_calls_parse_whole_and_streamed_with_the_model_s_ids(oai, choice):
    forced_chat_calls(oai, MODEL, choice)
    done = oai.chat.completions.create(model=MODEL, messages=USER, tools=CHAT_TOOLS,
                                       tool_choice=choice, max_tokens=MAX_TOKENS, temperature=0,
                                       parallel_tool_calls=False)
    # the id the grammar made the model write: what the template re-renders next turn
    assert all(re.fullmatch("[A-Za-z0-9]{9}", c.id) for c in done.choices[0].message.tool_calls)


def test_tool_choice_none_writes_no_call(oai):
    done = oai.chat.completions.create(model=MODEL, messages=USER, tools=CHAT_TOOLS,
                                       tool_choice="none", max_tokens=8, temperature=0)
    assert not done.choices[0].message.tool_calls
    assert done.choices[0].finish_reason in ("length", "stop")


def test_forced_calls_on_responses_and_messages(oai, base_url):
    claude = anthropic.Anthropic(base_url=base_url, api_key="unused", max_retries=0)
    forced_calls_on_responses_and_messages(oai, claude, MODEL)


def test_the_history_with_calls_extends_the_first_prompt(oai):
    cached, first = tool_loop_hit(oai, MODEL)
    assert cached >= first // PAGE_SIZE * PAGE_SIZE
