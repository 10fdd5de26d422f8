"""Mistral (Devstral, Mistral Small 3.2, Ministral 3): ``[TOOL_CALLS]NAME[ARGS]{json}``.

Each call starts with ``[TOOL_CALLS]``; a call ends where its JSON arguments end. Mistral
Small 3.2's template also writes ``[CALL_ID]<9 chars>`` before ``[ARGS]`` in the history; the
parser reads it, the grammar writes calls without it. Mistral Nemo's older
``[TOOL_CALLS][{...}]`` list is a different format (not registered yet).
"""

from __future__ import annotations

import json
import re
from collections.abc import Sequence

from prefixgate.gateway.server.tools.formats.base import ParsedCall, ToolCallFormat
from prefixgate.gateway.server.tools.formats.registry import register_format
from prefixgate.gateway.server.tools.records import FunctionTool

_DECODER = json.JSONDecoder()
_HEADER = re.compile(r"\[TOOL_CALLS\]([^\[\]\s]+)(?:\[CALL_ID\][A-Za-z0-9]*)?\[ARGS\]")


class MistralFormat(ToolCallFormat):
    name = "mistral"
    trigger = "[TOOL_CALLS]"
    end = ""  # the JSON object closes the call
    separator = ""

    def detect(self, template: str) -> bool:
        return "[TOOL_CALLS]" in template and "[ARGS]" in template

    def begin(self, tool_name: str) -> str:
        return f"[TOOL_CALLS]{tool_name}[ARGS]"

    def find_call(self, text: str, start: int) -> int | None:
        header = _HEADER.match(text, start)
        if header is None:
            return None  # incomplete header (or not one: finish() reports it)
        try:
            _, end = _DECODER.raw_decode(text, header.end())
        except json.JSONDecodeError:
            return None
        return end

    def parse_call(self, call_text: str, tools: Sequence[FunctionTool] = ()) -> ParsedCall | None:
        header = _HEADER.match(call_text)
        if header is None:
            return None
        try:
            arguments = json.loads(call_text[header.end() :])
        except json.JSONDecodeError:
            return None
        return ParsedCall(header.group(1), json.dumps(arguments, ensure_ascii=False))


MISTRAL = register_format(MistralFormat())
