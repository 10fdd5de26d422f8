"""Qwen3-Coder's XML calls (``<function=…><parameter=…>``) through the live gateway on the tiny
Qwen3-MoE model: the template renders the tools, the grammar writes a call exactly as the
template re-renders it (raw strings, ``True`` / ``False``), and every surface parses it into
the same typed call."""

from __future__ import annotations

import anthropic
import openai
import pytest

from tests.gateway.tools.family_server import (
    family_server,
    forced_calls_on_responses_and_messages,
    forced_chat_calls,
    tool_loop_hit,
)

MODEL = "tiny-qwen3-coder"
PAGE_SIZE = 16


@pytest.fixture(scope="module")
def base_url():
    with family_server("qwen3_moe", {"served_model_name": MODEL}) as (url,):
        yield url


@pytest.fixture(scope="module")
def oai(base_url):
    return openai.OpenAI(base_url=base_url + "/v1", api_key="unused", max_retries=0)


def test_a_forced_chat_call_parses_whole_and_streamed(oai):
    forced_chat_calls(oai, MODEL, "required")


def test_forced_calls_on_responses_and_messages(oai, base_url):
    claude = anthropic.Anthropic(base_url=base_url, api_key="unused", max_retries=0)
    forced_calls_on_responses_and_messages(oai, claude, MODEL)


def test_the_history_with_calls_extends_the_first_prompt(oai):
    cached, first = tool_loop_hit(oai, MODEL)
    assert cached >= first // PAGE_SIZE * PAGE_SIZE
