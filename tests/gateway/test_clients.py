"""What real clients send by default (issue 26, docs/clients.md), through the official openai
and anthropic SDKs against a live gateway on the default model: model-name aliases, Codex's
namespace and hosted tools, --default-max-tokens, runaway repeated calls, stop strings with a
forced call, a forced call with a JSON format, Claude Code's request shape and its
attribution line with a nonce that changes on every request."""

from __future__ import annotations

import json
import secrets
from collections.abc import Iterator

import anthropic
import httpx
import jsonschema
import openai
import pytest

from prefixgate.engine.config import EngineConfig
from prefixgate.gateway.server import ServerSettings
from tests.live_gateway import live_servers, wait_idle

pytestmark = pytest.mark.slow

ALIASES = ("claude-*", "gpt-5*")
DEFAULT_MAX_TOKENS = 6
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Get the weather for a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                   "required": ["city"]}}}
GREEDY = {"temperature": 0}  # this anthropic SDK release dropped the sampling arguments
PARIS = [{"role": "user", "content": "What's the weather in Paris?"}]
SYSTEM = ("You are a coding agent. You read files, run commands and answer briefly. "
          "Prefer small, safe steps and explain what you changed. ") * 40


@pytest.fixture(scope="module")
def server_url(loaded_model) -> Iterator[str]:
    from prefixgate.engine.async_engine import build_engine

    engine = build_engine(EngineConfig(num_pages=512, page_size=16), loaded=loaded_model)
    settings = ServerSettings(host="127.0.0.1", port=0, log_level="warning",
                              model_aliases=ALIASES, default_max_tokens=DEFAULT_MAX_TOKENS)
    with live_servers(engine, [settings]) as (server,):
        yield server.base_url


@pytest.fixture()
def gpt(server_url) -> openai.OpenAI:
    return openai.OpenAI(base_url=server_url + "/v1", api_key="unused", max_retries=0, timeout=120)


@pytest.fixture()
def claude(server_url) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=server_url, api_key="unused", max_retries=0, timeout=120)


def clients_stats(server_url: str) -> dict[str, int]:
    return httpx.get(server_url + "/v1/cache/stats", timeout=30).json()["clients"]


def test_model_aliases_answer_claude_and_gpt_names(gpt, claude):
    chat = gpt.chat.completions.create(model="gpt-5.1-codex", messages=PARIS, max_tokens=2)
    assert chat.usage.completion_tokens >= 1
    message = claude.messages.create(model="claude-sonnet-4-5", max_tokens=2, messages=PARIS)
    assert message.usage.output_tokens >= 1
    with pytest.raises(openai.NotFoundError):
        gpt.chat.completions.create(model="llama-3", messages=PARIS, max_tokens=2)


def test_default_max_tokens_applies_only_when_none_is_sent(gpt, server_url):
    story = [{"role": "user", "content": "Write a long story about a dragon and a knight."}]
    before = clients_stats(server_url)["default_max_tokens_applied"]
    chat = gpt.chat.completions.create(model="gpt-5", messages=story, temperature=0)
    assert chat.usage.completion_tokens == DEFAULT_MAX_TOKENS
    assert chat.choices[0].finish_reason == "length"
    asked = gpt.chat.completions.create(model="gpt-5", messages=story, temperature=0, max_tokens=9)
    assert asked.usage.completion_tokens == 9  # the request's own value is kept
    response = gpt.responses.create(model="gpt-5", input=story[0]["content"], temperature=0)
    assert response.usage.output_tokens == DEFAULT_MAX_TOKENS
    completion = gpt.completions.create(model="gpt-5", prompt="1, 2, 3, 4, 5, 6,", temperature=0)
    assert completion.usage.completion_tokens == DEFAULT_MAX_TOKENS
    assert completion.choices[0].finish_reason == "length"
    assert clients_stats(server_url)["default_max_tokens_applied"] == before + 3


def test_codex_namespace_and_hosted_tools_round_trip(gpt, server_url):
    spawn = {"type": "function", "name": "spawn_agent", "description": "Start a sub-agent.",
             "strict": False, "parameters": {"type": "object", "properties": {
                 "task": {"type": "string"}}, "required": ["task"]}}
    tools = [{"type": "namespace", "name": "multi_agent_v1",
              "description": "Tools for spawning and managing sub-agents.", "tools": [spawn]},
             {"type": "web_search", "external_web_access": False}]
    before = clients_stats(server_url)["hosted_tools_dropped"]
    raw = gpt.responses.with_raw_response.create(
        model="gpt-5.1-codex", input="Start a sub-agent that lists the files.", tools=tools,
        tool_choice="required", temperature=0, max_output_tokens=48, store=False)
    assert raw.headers["x-prefixgate-dropped-tools"] == "web_search"
    response = raw.parse()
    (call,) = [item for item in response.output if item.type == "function_call"]
    assert (call.name, call.namespace) == ("spawn_agent", "multi_agent_v1")
    jsonschema.validate(json.loads(call.arguments), spawn["parameters"])
    assert clients_stats(server_url)["hosted_tools_dropped"] == before + 1
    # the next turn sends the call back (with its namespace) and its output: accepted
    follow = gpt.responses.create(model="gpt-5.1-codex", tools=tools, max_output_tokens=4,
                                  store=False, input=[
        {"role": "user", "content": "Start a sub-agent that lists the files."},
        {"type": "function_call", "call_id": call.call_id, "name": call.name,
         "namespace": call.namespace, "arguments": call.arguments},
        {"type": "function_call_output", "call_id": call.call_id, "output": "agent-1 started"}])
    assert follow.status in ("completed", "incomplete")


def test_an_exact_repeat_of_a_call_ends_the_turn_on_every_surface(gpt, claude, server_url):
    # the default model repeats get_weather({"city": "Paris"}) until max_tokens (issue 26)
    before = clients_stats(server_url)["repeated_calls_cut"]
    chat = gpt.chat.completions.create(model="gpt-5", messages=PARIS, tools=[WEATHER],
                                       tool_choice="required", temperature=0, max_tokens=120)
    choice = chat.choices[0]
    assert choice.finish_reason == "tool_calls"
    assert [(c.function.name, json.loads(c.function.arguments)) for c in
            choice.message.tool_calls] == [("get_weather", {"city": "Paris"})]
    stream = gpt.chat.completions.create(model="gpt-5", messages=PARIS, tools=[WEATHER],
                                         tool_choice="required", temperature=0, max_tokens=120,
                                         stream=True)
    chunks = [c.choices[0] for c in stream if c.choices]
    assert chunks[-1].finish_reason == "tool_calls"
    streamed = [d for c in chunks for d in c.delta.tool_calls or ()]
    assert {d.index for d in streamed} == {0}  # one call, the repeat never streamed
    assert json.loads("".join(d.function.arguments or "" for d in streamed)) == {"city": "Paris"}
    function = {"type": "function", **WEATHER["function"]}
    response = gpt.responses.create(model="gpt-5", input=PARIS[0]["content"], tools=[function],
                                    tool_choice="required", temperature=0,
                                    max_output_tokens=120)
    assert response.status == "completed"
    assert [(item.type, json.loads(item.arguments)) for item in response.output] == [
        ("function_call", {"city": "Paris"})]
    message = claude.messages.create(
        model="claude-haiku-4-5", max_tokens=120, extra_body=GREEDY, messages=PARIS,
        tool_choice={"type": "any"}, tools=[{"name": "get_weather",
                                             "input_schema": WEATHER["function"]["parameters"]}])
    assert message.stop_reason == "tool_use"
    assert [(block.type, block.input) for block in message.content] == [
        ("tool_use", {"city": "Paris"})]
    # streamed, Responses and Messages too
    with gpt.responses.stream(model="gpt-5", input=PARIS[0]["content"], tools=[function],
                              tool_choice="required", temperature=0,
                              max_output_tokens=120) as events:
        streamed = events.get_final_response()
    assert streamed.status == "completed"
    assert [(item.type, json.loads(item.arguments)) for item in streamed.output] == [
        ("function_call", {"city": "Paris"})]
    with claude.messages.stream(
            model="claude-haiku-4-5", max_tokens=120, extra_body=GREEDY, messages=PARIS,
            tool_choice={"type": "any"}, tools=[{
                "name": "get_weather", "input_schema": WEATHER["function"]["parameters"]}]) as events:
        final = events.get_final_message()
    assert final.stop_reason == "tool_use"
    assert [(block.type, block.input) for block in final.content] == [
        ("tool_use", {"city": "Paris"})]
    assert clients_stats(server_url)["repeated_calls_cut"] == before + 6
    with httpx.Client(base_url=server_url, timeout=30) as client:
        stats = wait_idle(client)  # the requests ended early released every page
    assert stats["pages_used"] == stats["pages_pinned"] == 0


def test_the_cut_never_changes_a_turn_without_a_repeat(gpt):
    # n=2 choices are never cut (they cannot end alone): greedy choice 0 is the uncut output
    asks = [PARIS, [{"role": "user", "content": "Weather in Paris and in London, please."}],
            [{"role": "user", "content": "Is it raining in Tokyo?"}]]
    unchanged = 0
    for messages in asks:
        kwargs = dict(model="gpt-5", messages=messages, tools=[WEATHER], tool_choice="required",
                      temperature=0, max_tokens=120)
        cut = gpt.chat.completions.create(**kwargs).choices[0]
        whole = gpt.chat.completions.create(n=2, **kwargs).choices[0]
        calls = [(c.function.name, c.function.arguments) for c in whole.message.tool_calls]
        unique = []
        for call in calls:
            if call in unique:
                break
            unique.append(call)
        assert [(c.function.name, c.function.arguments) for c in cut.message.tool_calls] == unique
        if len(unique) == len(calls):  # no repeat: the very same turn
            assert cut.finish_reason == whole.finish_reason
            unchanged += 1
        print(f"{messages[0]['content']!r}: {len(calls)} calls, {len(unique)} unique")
    assert unchanged >= 1  # a real output without a repeat went through the guard untouched


def test_stop_strings_keep_a_forced_calls_finish_reason(gpt, claude):
    # smolagents: stop strings plus tool_choice "required"
    chat = gpt.chat.completions.create(model="gpt-5", messages=PARIS, tools=[WEATHER],
                                       tool_choice="required", temperature=0, max_tokens=120,
                                       stop=["Observation:", "Calling tools:"])
    choice = chat.choices[0]
    assert choice.finish_reason == "tool_calls"
    assert json.loads(choice.message.tool_calls[0].function.arguments) == {"city": "Paris"}
    # one call: the grammar ends the output, and the text held back in case it started a stop
    # string (the call's closing tag) is still output
    one = gpt.chat.completions.create(model="gpt-5", messages=PARIS, tools=[WEATHER],
                                      tool_choice="required", parallel_tool_calls=False,
                                      temperature=0, max_tokens=60,
                                      stop=["Observation:", "Calling tools:"])
    assert one.choices[0].finish_reason == "tool_calls"
    assert len(one.choices[0].message.tool_calls) == 1
    # the same on Messages (stop_sequences with a forced call)
    message = claude.messages.create(
        model="claude-haiku-4-5", max_tokens=60, extra_body=GREEDY, messages=PARIS,
        stop_sequences=["Observation:", "Calling tools:"],
        tool_choice={"type": "any", "disable_parallel_tool_use": True},
        tools=[{"name": "get_weather", "input_schema": WEATHER["function"]["parameters"]}])
    assert message.stop_reason == "tool_use"
    assert [(b.type, b.input) for b in message.content] == [("tool_use", {"city": "Paris"})]


def test_a_forced_call_wins_over_a_json_text_format(gpt, claude):
    # instructor: a forced function tool_choice plus a JSON-schema text.format
    function = {"type": "function", **WEATHER["function"]}
    response = gpt.responses.create(
        model="gpt-5", input=PARIS[0]["content"], tools=[function], temperature=0,
        tool_choice={"type": "function", "name": "get_weather"}, max_output_tokens=40,
        text={"format": {"type": "json_schema", "name": "Weather", "schema": {
            "type": "object", "properties": {"summary": {"type": "string"}}}}})
    assert [(item.type, item.name) for item in response.output] == [("function_call", "get_weather")]
    jsonschema.validate(json.loads(response.output[0].arguments), function["parameters"])
    # the same on chat (response_format) and Messages (output_config.format)
    chat = gpt.chat.completions.create(
        model="gpt-5", messages=PARIS, tools=[WEATHER], temperature=0, max_tokens=40,
        tool_choice={"type": "function", "function": {"name": "get_weather"}},
        response_format={"type": "json_schema", "json_schema": {"name": "Weather", "schema": {
            "type": "object", "properties": {"summary": {"type": "string"}}}}})
    assert chat.choices[0].finish_reason == "tool_calls"
    (call,) = chat.choices[0].message.tool_calls
    jsonschema.validate(json.loads(call.function.arguments), WEATHER["function"]["parameters"])
    message = claude.messages.create(
        model="claude-haiku-4-5", max_tokens=40, messages=PARIS,
        tool_choice={"type": "tool", "name": "get_weather"},
        tools=[{"name": "get_weather", "input_schema": WEATHER["function"]["parameters"]}],
        extra_body={**GREEDY, "output_config": {"format": {"type": "json_schema", "schema": {
            "type": "object", "properties": {"summary": {"type": "string"}}}}}})
    assert message.stop_reason == "tool_use"
    assert [b.type for b in message.content] == ["tool_use"]
    jsonschema.validate(message.content[0].input, WEATHER["function"]["parameters"])


def test_claude_codes_request_shape_is_accepted(claude, server_url):
    # mid-conversation system messages, a tool description past the old 8,192-character cap
    # (Claude Code's longest is 18,780), max_tokens past the context, adaptive thinking,
    # context_management
    description = ("Run a workflow step by step. " * 400)[:9_000]
    message = claude.messages.create(
        model="claude-opus-4-8", max_tokens=64_000,
        system=[{"type": "text", "text": SYSTEM}],
        messages=[{"role": "user", "content": "Say hi."},
                  {"role": "system", "content": "Available agent types: none."}],  # type: ignore[list-item]
        tools=[{"name": "Workflow", "description": description,
                "input_schema": {"type": "object", "properties": {}}}],
        thinking={"type": "adaptive"},  # type: ignore[arg-type]
        extra_body={**GREEDY, "context_management": {"edits": [
            {"type": "clear_thinking_20251015"}]}},
        stop_sequences=["\n"])
    assert message.stop_reason in ("end_turn", "stop_sequence", "tool_use")
    assert clients_stats(server_url)["max_tokens_clamped"] >= 1
    with pytest.raises(anthropic.BadRequestError, match="description"):  # still bounded
        claude.messages.create(model="claude-opus-4-8", max_tokens=4, messages=PARIS, tools=[
            {"name": "Workflow", "description": "x" * 40_000, "input_schema": {"type": "object"}}])


def test_a_changing_attribution_nonce_keeps_the_cache(claude, server_url):
    """cch= and the version suffix change on every request (interactive Claude Code): the
    model never sees them, every turn reads the last one's pages, and the usage says so."""
    before = clients_stats(server_url)["attribution_blocks_removed"]
    messages: list[dict] = []
    usages = []
    for turn in ("List the files.", "Now open the README.", "Summarise it in one line."):
        billing = (f"x-anthropic-billing-header: cc_version=2.1.197.{secrets.token_hex(2)[:3]}; "
                   f"cc_entrypoint=cli; cch={secrets.token_hex(3)[:5]};")
        system = [{"type": "text", "text": billing}, {"type": "text", "text": SYSTEM}]
        messages.append({"role": "user", "content": turn})
        hits = httpx.get(server_url + "/v1/cache/stats", timeout=30).json()["global"]["hit_tokens"]
        reply = claude.messages.create(model="claude-sonnet-4-5", max_tokens=8, extra_body=GREEDY,
                                       system=system, messages=messages)
        # the usage is true: the gateway's own counter moved by exactly what it reports
        hits = httpx.get(server_url + "/v1/cache/stats", timeout=30).json()["global"]["hit_tokens"] - hits
        assert hits == reply.usage.cache_read_input_tokens, (hits, reply.usage)
        counted = claude.messages.count_tokens(model="claude-sonnet-4-5", system=system,
                                               messages=messages).input_tokens
        plain = claude.messages.count_tokens(model="claude-sonnet-4-5", messages=messages,
                                             system=SYSTEM).input_tokens
        assert counted == plain  # the nonce never reaches the prompt
        usages.append(reply.usage)
        messages.append({"role": "assistant", "content": reply.content[0].text
                         if reply.content else ""})
    for usage in usages[1:]:
        prompt = usage.input_tokens + usage.cache_creation_input_tokens + usage.cache_read_input_tokens
        assert usage.cache_read_input_tokens >= 0.9 * prompt, usage
    assert clients_stats(server_url)["attribution_blocks_removed"] == before + 3
