"""Harmony through the live gateway on the tiny random gpt-oss (tests/harmony_fixture.py: the
real o200k_harmony tokenizer and gpt-oss's template): a forced call is written in harmony's
syntax, the engine stops on ``<|call|>``, and every surface parses the call, whole and
streamed; no harmony marker reaches a client (the analysis channel is reasoning)."""

from __future__ import annotations

import anthropic
import openai
import pytest

from prefixgate.gateway.engine.config import EngineConfig
from prefixgate.gateway.engine.engine import build_engine
from prefixgate.gateway.engine.loader import load_model
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

