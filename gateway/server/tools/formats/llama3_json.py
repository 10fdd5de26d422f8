"""Llama 3.1 / 3.2 / 3.3: a bare JSON object ``{"name": NAME, "parameters": ARGS}``.

The template tells the model to answer a call with that object alone (optionally after
``<|python_tag|>``, which is how the model marks code and built-in tool calls); the call ends
at the object's closing brace and the turn at ``<|eom_id|>`` / ``<|eot_id|>``.
"""

from __future__ import annotations

import json
from collections.abc import Sequence

from prefixgate.gateway.server.tools.formats.base import ParsedCall, ToolCallFormat
from prefixgate.gateway.server.tools.formats.registry import register_format
from prefixgate.gateway.server.tools.records import FunctionTool

_DECODER = json.JSONDecoder()
PYTHON_TAG = "<|python_tag|>"


class Llama3JsonFormat(ToolCallFormat):
    name = "llama3_json"
    trigger = '{"name": '
    end = "}"
    separator = "; "

    def detect(self, template: str) -> bool:
        # the 3.1+ templates describe the JSON call with a "parameters" key and the ipython role
        return '"parameters": dictionary of argument name and its value' in template or (
            "<|python_tag|>" in template and "ipython" in template
        )

    def begin(self, tool_name: str) -> str:
        return f'{{"name": {json.dumps(tool_name, ensure_ascii=False)}, "parameters": '

    def find_call(self, text: str, start: int) -> int | None:
        try:
            _, end = _DECODER.raw_decode(text, start)
        except json.JSONDecodeError:
            return None  # incomplete (or not JSON: finish() reports it)
        return end

    def parse_call(self, call_text: str, tools: Sequence[FunctionTool] = ()) -> ParsedCall | None:
        try:
            value = json.loads(call_text)
        except json.JSONDecodeError:
            return None
        if not isinstance(value, dict) or not isinstance(value.get("name"), str):
            return None
        arguments = value.get("parameters", value.get("arguments", {}))
        return ParsedCall(value["name"], json.dumps(arguments, ensure_ascii=False))


LLAMA3_JSON = register_format(Llama3JsonFormat())
