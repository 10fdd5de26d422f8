"""Hermes / Qwen2.5 / Qwen3: ``<tool_call>\\n{"name": NAME, "arguments": ARGS}\\n</tool_call>``."""

from __future__ import annotations

import json
from collections.abc import Sequence

from prefixgate.gateway.server.tools.formats.base import ParsedCall, ToolCallFormat
from prefixgate.gateway.server.tools.formats.registry import register_format
from prefixgate.gateway.server.tools.records import FunctionTool


class HermesFormat(ToolCallFormat):
    name = "hermes"
    trigger = "<tool_call>"
    end = "}\n</tool_call>"

    def detect(self, template: str) -> bool:
        return "<tool_call>" in template

    def begin(self, tool_name: str) -> str:
        return f'<tool_call>\n{{"name": {json.dumps(tool_name, ensure_ascii=False)}, "arguments": '

    def find_call(self, text: str, start: int) -> int | None:
        # the grammar writes "}\n</tool_call>"; unconstrained text may space it differently
        close = text.find("</tool_call>", start)
        return None if close < 0 else close + len("</tool_call>")

    def parse_call(self, call_text: str, tools: Sequence[FunctionTool] = ()) -> ParsedCall | None:
        body = call_text.removeprefix(self.trigger).removesuffix("</tool_call>").strip()
        try:
            value = json.loads(body)
        except json.JSONDecodeError:
            return None
        if not isinstance(value, dict) or not isinstance(value.get("name"), str):
            return None
        arguments = value.get("arguments", value.get("parameters", {}))
        return ParsedCall(value["name"], json.dumps(arguments, ensure_ascii=False))


HERMES = register_format(HermesFormat())
