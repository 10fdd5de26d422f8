"""Granite 3.x: ``<|tool_call|>[{"name": NAME, "arguments": ARGS}]``.

The template lists the tools (``available_tools``) and tells the model to answer a call with
``<|tool_call|>`` and a JSON list; the grammar writes one call per list (a parallel call opens
another). The template renders only an assistant turn's ``content``, never its
``tool_calls``: ``history_messages`` writes the calls into the content exactly as the grammar
wrote them, so the model sees its calls and the next turn's prompt extends this one's tokens.
(Granite 4's template uses Hermes ``<tool_call>``.)
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

from prefixgate.gateway.server.tools.formats.base import ParsedCall, ToolCallFormat
from prefixgate.gateway.server.tools.formats.registry import register_format
from prefixgate.gateway.server.tools.records import FunctionTool

_DECODER = json.JSONDecoder()
TOOL_CALL = "<|tool_call|>"


class GraniteFormat(ToolCallFormat):
    name = "granite"
    trigger = TOOL_CALL
    end = "}]"

    def detect(self, template: str) -> bool:
        return TOOL_CALL in template

    def begin(self, tool_name: str) -> str:
        return f'{TOOL_CALL}[{{"name": {json.dumps(tool_name, ensure_ascii=False)}, "arguments": '

    def find_call(self, text: str, start: int) -> int | None:
        try:
            _, end = _DECODER.raw_decode(text, start + len(TOOL_CALL))
        except json.JSONDecodeError:
            return None  # incomplete (or not a list: finish() reports it)
        return end

    def parse_call(self, call_text: str, tools: Sequence[FunctionTool] = ()) -> ParsedCall | None:
        calls = self.parse_calls(call_text, tools)
        return calls[0] if calls else None

    def parse_calls(self, call_text: str, tools: Sequence[FunctionTool] = ()) -> list[ParsedCall]:
        try:
            value = json.loads(call_text.removeprefix(TOOL_CALL))
        except json.JSONDecodeError:
            return []
        items = value if isinstance(value, list) else [value]
        if not items or not all(isinstance(i, dict) and isinstance(i.get("name"), str)
                                for i in items):
            return []
        return [ParsedCall(i["name"], json.dumps(i.get("arguments", {}), ensure_ascii=False))
                for i in items]

    def history_messages(self, messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
        out = []
        for message in messages:
            calls = message.get("tool_calls")
            if message.get("role") == "assistant" and calls:
                written = "\n".join(self._call(c.get("function") or {}) for c in calls)
                content = message.get("content") or ""
                message = {**message, "content": f"{content}{written}"}
            out.append(message)
        return out

    def _call(self, function: dict[str, Any]) -> str:
        arguments = function.get("arguments", {})
        # a string here is a call whose arguments were not JSON (tools/prompt.py RawArguments)
        text = arguments if isinstance(arguments, str) else json.dumps(arguments,
                                                                      ensure_ascii=False)
        return self.begin(str(function.get("name", ""))) + text + self.end


GRANITE = register_format(GraniteFormat())
