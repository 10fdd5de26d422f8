"""Tools into the prompt, in one documented, deterministic format (Hermes/Qwen style).

When the model's chat template does not render tools (the default SmolLM2 does not), the
gateway writes them itself:

* the tools section goes at the end of the first system turn (or is the system turn):
  one line of JSON per function, ``{"type": "function", "function": {"name", "description",
  "parameters"}}``, inside ``<tools></tools>``;
* an assistant turn that called tools is its text (if any), a newline, then each call as
  ``<tool_call>\\n{"name": NAME, "arguments": ARGS}\\n</tool_call>``, calls separated by "\\n";
* ``role: "tool"`` results become a user turn of ``<tool_response>\\n...\\n</tool_response>``
  blocks (consecutive results share one turn).

Serialisation is canonical: ``json.dumps`` with its default separators and the caller's key
order, ``ensure_ascii=False``, ``strict`` left out (it changes the grammar, not what the model
reads). So the same tool list is the same text, the same tokens and the same pages for the
whole swarm; and a call the model generated (the grammar writes exactly this JSON form)
re-renders byte for byte into the next turn, which therefore extends this turn's tokens.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from typing import Any

from prefixgate.engine.api import InvalidRequestError
from prefixgate.gateway.server.tools.records import FunctionTool

TOOL_CALL_OPEN = "<tool_call>"
TOOL_CALL_CLOSE = "</tool_call>"
CALL_END = "}\n" + TOOL_CALL_CLOSE
CALL_SEPARATOR = "\n"

TOOLS_INTRO = (
    "# Tools\n\n"
    "You may call one or more functions to help with the user's request. The functions are "
    "described by JSON schemas inside <tools></tools>:\n<tools>\n"
)
TOOLS_OUTRO = (
    "\n</tools>\n\n"
    "To call a function, write a JSON object with its name and arguments inside "
    "<tool_call></tool_call> tags:\n"
    '<tool_call>\n{"name": <function-name>, "arguments": <arguments-json-object>}\n</tool_call>'
)


def canonical_json(value: Any) -> str:
    return json.dumps(value, ensure_ascii=False)


class RawArguments(str):
    """Call arguments that are not valid JSON (a call cut by max_tokens, sent back by a
    client): rendered verbatim, as the model wrote them."""


def call_begin(name: str) -> str:
    """The fixed text before a call's arguments (the grammar's tag begins with it)."""
    return f'{TOOL_CALL_OPEN}\n{{"name": {canonical_json(name)}, "arguments": '


def render_call(name: str, arguments: Any) -> str:
    text = arguments if isinstance(arguments, RawArguments) else canonical_json(arguments)
    return call_begin(name) + text + CALL_END


def tool_json(tool: FunctionTool) -> dict[str, Any]:
    function: dict[str, Any] = {"name": tool.name}
    if tool.description:
        function["description"] = tool.description
    function["parameters"] = tool.schema
    return {"type": "function", "function": function}


def tools_section(tools: Sequence[FunctionTool]) -> str:
    return TOOLS_INTRO + "\n".join(canonical_json(tool_json(t)) for t in tools) + TOOLS_OUTRO


def _arguments(call: dict[str, Any], param: str) -> tuple[str, Any]:
    function = call.get("function") if isinstance(call, dict) else None
    if not isinstance(function, dict) or not isinstance(function.get("name"), str):
        raise InvalidRequestError("a tool call needs function.name", param=param)
    raw = function.get("arguments", "{}")
    if isinstance(raw, str):
        try:
            raw = json.loads(raw) if raw.strip() else {}
        except json.JSONDecodeError:
            # OpenAI takes any string here, and clients send back what they got, a call cut
            # short by max_tokens included: keep it verbatim rather than refuse the history
            raw = RawArguments(raw)
    return function["name"], raw


def assistant_text(content: str | None, calls: Sequence[dict[str, Any]],
                   param: Callable[[int], str]) -> str:
    """An assistant turn that called tools, as the model would have written it."""
    rendered = CALL_SEPARATOR.join(render_call(*_arguments(c, param(j))) for j, c in enumerate(calls))
    return f"{content}\n{rendered}" if content else rendered


def tool_response(content: str) -> str:
    return f"<tool_response>\n{content}\n</tool_response>"


def prepare_messages(messages: list[dict[str, Any]], tools: Sequence[FunctionTool] | None,
                     *, message_param: str = "messages", system_turn: bool = True
                     ) -> list[dict[str, Any]]:
    """Template messages with the tools, calls and results written in the gateway's format.

    Args:
        messages: OpenAI-style template dicts (``role``, ``content``, ``tool_calls``...).
        tools: the visible tools (None or empty: no tools section).
        message_param: the request field the messages came from (error messages name it).
        system_turn: the template takes a system turn; if not (Gemma 2), a conversation
            without one gets the tools section at the start of its first turn instead.
    """
    out: list[dict[str, Any]] = []
    tool_turn = False  # the last output message is a user turn of tool results
    for i, message in enumerate(messages):
        role = message["role"]
        if role == "assistant" and message.get("tool_calls"):
            text = assistant_text(message.get("content") or None, message["tool_calls"],
                                  lambda j, i=i: f"{message_param}[{i}].tool_calls[{j}]")
            out.append({"role": "assistant", "content": text})
            tool_turn = False
        elif role == "tool":
            block = tool_response(message.get("content") or "")
            if tool_turn:
                out[-1]["content"] += "\n" + block
            else:
                out.append({"role": "user", "content": block})
                tool_turn = True
        else:
            out.append({k: v for k, v in message.items() if k in ("role", "content", "name")})
            tool_turn = False
    if tools:
        section = tools_section(tools)
        if out and out[0]["role"] == "system":
            first = out[0]["content"]
            out[0] = {**out[0], "content": f"{first}\n\n{section}" if first else section}
        elif out and not system_turn:
            first = out[0]["content"]
            out[0] = {**out[0], "content": f"{section}\n\n{first}" if first else section}
        else:
            out.insert(0, {"role": "system", "content": section})
    return out


def native_messages(messages: list[dict[str, Any]], *, message_param: str = "messages"
                    ) -> list[dict[str, Any]]:
    """Messages for a template that renders tools itself: call arguments as objects (the
    Hugging Face convention, ``tool_call.arguments | tojson``)."""
    out = []
    for i, message in enumerate(messages):
        calls = message.get("tool_calls")
        if calls:
            converted = []
            for j, call in enumerate(calls):
                name, arguments = _arguments(call, f"{message_param}[{i}].tool_calls[{j}]")
                converted.append({**call, "type": "function",
                                  "function": {"name": name, "arguments": arguments}})
            message = {**message, "tool_calls": converted}
        out.append(message)
    return out
