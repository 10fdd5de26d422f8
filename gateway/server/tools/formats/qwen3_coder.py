"""Qwen3-Coder (and Qwen3.5): XML calls.

    <tool_call>
    <function=NAME>
    <parameter=KEY>
    VALUE
    </parameter>
    </function>
    </tool_call>

String values are written raw; other values as JSON. The grammar is xgrammar's ``qwen_xml``
JSON-schema style; the parser types each value by the tool's schema (raw text for strings,
JSON otherwise, raw text when it does not parse).
"""

from __future__ import annotations

import json
import re
from collections.abc import Sequence
from typing import Any

from prefixgate.gateway.server.tools.formats.base import ParsedCall, ToolCallFormat
from prefixgate.gateway.server.tools.formats.registry import register_format
from prefixgate.gateway.server.tools.grammar import check_schema
from prefixgate.gateway.server.tools.records import FunctionTool

_FUNCTION = re.compile(r"<function=([^>\n]+)>(.*?)</function>", re.DOTALL)
_PARAMETER = re.compile(r"<parameter=([^>\n]+)>\n?(.*?)\n?</parameter>", re.DOTALL)


class Qwen3CoderFormat(ToolCallFormat):
    name = "qwen3_coder"
    trigger = "<tool_call>\n<function="
    end = "\n</function>\n</tool_call>"
    priority = 10  # its template also contains "<tool_call>" (Hermes' marker)

    def detect(self, template: str) -> bool:
        return "<function=" in template and "<parameter=" in template

    def begin(self, tool_name: str) -> str:
        return f"<tool_call>\n<function={tool_name}>\n"

    def content(self, tool: FunctionTool, param: str = "tools", scope: str = "") -> dict[str, Any]:
        check_schema(tool.schema, param, object_only=True)  # the same bounds as JSON formats
        return {"type": "json_schema", "json_schema": tool.schema, "style": "qwen_xml"}

    def find_call(self, text: str, start: int) -> int | None:
        close = text.find("</tool_call>", start)
        return None if close < 0 else close + len("</tool_call>")

    def parse_call(self, call_text: str, tools: Sequence[FunctionTool] = ()) -> ParsedCall | None:
        match = _FUNCTION.search(call_text)
        if match is None:
            return None
        name = match.group(1).strip()
        schema = next((t.schema for t in tools if t.name == name), {})
        properties = schema.get("properties", {})
        arguments = {
            key.strip(): _value(raw, properties.get(key.strip(), {}))
            for key, raw in _PARAMETER.findall(match.group(2))
        }
        return ParsedCall(name, json.dumps(arguments, ensure_ascii=False))


def _value(raw: str, schema: dict[str, Any]) -> Any:
    if schema.get("type") == "string":
        return raw
    try:
        return json.loads(raw)
    except json.JSONDecodeError:
        return raw


QWEN3_CODER = register_format(Qwen3CoderFormat())
