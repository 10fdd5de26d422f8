"""Qwen3-Coder (and Qwen3.5): XML calls.

    <tool_call>
    <function=NAME>
    <parameter=KEY>
    VALUE
    </parameter>
    </function>
    </tool_call>

String values are written raw, booleans as the template's ``| string`` renders them
(``True`` / ``False``), objects and arrays as canonical JSON. The grammar writes exactly what
the template re-renders (each declared parameter once, in the schema's order, no free
whitespace: xgrammar's own ``qwen_xml`` style lets a weak model pad with whitespace forever),
so the next turn's prompt extends this one's tokens. The parser types each value by the tool's
schema (raw text for strings, JSON or Python-style booleans otherwise, raw text when neither).
"""

from __future__ import annotations

import json
import re
from collections.abc import Sequence
from typing import Any

from prefixgate.gateway.server.tools.formats.base import ParsedCall, ToolCallFormat
from prefixgate.gateway.server.tools.formats.registry import register_format
from prefixgate.gateway.server.tools.grammar import check_schema, schema_grammar
from prefixgate.gateway.server.tools.records import FunctionTool

_FUNCTION = re.compile(r"<function=([^>\n]+)>(.*?)</function>", re.DOTALL)
_PARAMETER = re.compile(r"<parameter=([^>\n]+)>\n?(.*?)\n?</parameter>", re.DOTALL)


class Qwen3CoderFormat(ToolCallFormat):
    name = "qwen3_coder"
    trigger = "<tool_call>\n<function="
    end = "</function>\n</tool_call>"  # every parameter ends with its own newline
    priority = 10  # its template also contains "<tool_call>" (Hermes' marker)

    def detect(self, template: str) -> bool:
        return "<function=" in template and "<parameter=" in template

    def begin(self, tool_name: str) -> str:
        return f"<tool_call>\n<function={tool_name}>\n"

    def content(self, tool: FunctionTool, param: str = "tools", scope: str = "") -> dict[str, Any]:
        schema = tool.schema
        check_schema(schema, param, object_only=True)  # the same bounds as JSON formats
        required = set(schema.get("required") or ())
        elements: list[dict[str, Any]] = []
        for key, sub in (schema.get("properties") or {}).items():
            one = _const(f"<parameter={key}>\n"), _value_element(sub, param, scope), _const(
                "\n</parameter>\n")
            element: dict[str, Any] = {"type": "sequence", "elements": list(one)}
            if key not in required:
                element = {"type": "or", "elements": [element, _const("")]}
            elements.append(element)
        return {"type": "sequence", "elements": elements or [_const("")]}

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


def _const(text: str) -> dict[str, Any]:
    return {"type": "const_string", "value": text}


def _value_element(schema: Any, param: str, scope: str) -> dict[str, Any]:
    """One parameter's value as the template renders it (``| string`` or ``tojson``)."""
    kind = schema.get("type") if isinstance(schema, dict) else None
    if kind == "string" and isinstance(schema.get("enum"), list):
        return {"type": "or", "elements": [_const(str(v)) for v in schema["enum"]]}
    if kind == "boolean":
        return {"type": "or", "elements": [_const("True"), _const("False")]}
    if kind in ("integer", "number", "object", "array"):
        return {"type": "grammar", "grammar": schema_grammar(schema, param, scope=scope)}
    # raw text; it may not hold "</pa" (the start of its closing tag)
    return {"type": "regex", "pattern": "([^<]|<[^/]|</[^p]|</p[^a])*"}


_PYTHON_WORDS = {"True": True, "False": False, "None": None}


def _value(raw: str, schema: dict[str, Any]) -> Any:
    if schema.get("type") == "string":
        return raw
    if raw in _PYTHON_WORDS:  # the template's ``| string`` of a boolean
        return _PYTHON_WORDS[raw]
    try:
        return json.loads(raw)
    except json.JSONDecodeError:
        return raw


QWEN3_CODER = register_format(Qwen3CoderFormat())
