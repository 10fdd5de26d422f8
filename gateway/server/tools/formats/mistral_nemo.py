"""Mistral Nemo (2407): ``[TOOL_CALLS][{"name": NAME, "arguments": ARGS, "id": ID}, ...]``.

Every call of a turn sits in ONE JSON list after ``[TOOL_CALLS]``. The template writes a call
into the history as ``tool_call.function | tojson`` with ``, "id": "<9 alphanumerics>"`` added,
calls joined by ``", "``: the grammar (``block``: tools/grammar.py) has the model write exactly
that, its own id included, and the parser makes that id the call's id, so the client sends it
back and the next turn re-renders what was generated. The template refuses any other id:
``history_messages`` maps a client's ids onto 9 alphanumerics as formats/mistral.py does. The
parser also takes a list without ids, or with arguments as a JSON string.
"""

from __future__ import annotations

import json
import re
from collections.abc import Sequence
from typing import Any

from prefixgate.gateway.server.tools.formats.base import ParsedCall, ToolCallFormat
from prefixgate.gateway.server.tools.formats.mistral import with_history_call_ids
from prefixgate.gateway.server.tools.formats.registry import register_format
from prefixgate.gateway.server.tools.records import FunctionTool

_DECODER = json.JSONDecoder()
TOOL_CALLS = "[TOOL_CALLS]"
_ID = re.compile(r"[A-Za-z0-9]{9}")


def _arguments(value: Any) -> str | None:
    """A call's arguments as JSON object text; None when they are not an object."""
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError:
            return None
    return json.dumps(value, ensure_ascii=False) if isinstance(value, dict) else None


class MistralNemoFormat(ToolCallFormat):
    name = "mistral_nemo"
    trigger = TOOL_CALLS
    block = (f"{TOOL_CALLS}[", "]")
    end = '"}'  # after the id
    separator = ", "

    def detect(self, template: str) -> bool:
        return f"{TOOL_CALLS}[" in template

    def begin(self, tool_name: str) -> str:
        return f'{{"name": {json.dumps(tool_name, ensure_ascii=False)}, "arguments": '

    def content(self, tool: FunctionTool, param: str = "tools", scope: str = "") -> dict[str, Any]:
        return {"type": "sequence", "elements": [
            super().content(tool, param, scope), {"type": "const_string", "value": ', "id": "'},
            {"type": "regex", "pattern": "[A-Za-z0-9]{9}"}]}  # fmt: skip

    def history_messages(self, messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
        return with_history_call_ids(messages)

    def find_call(self, text: str, start: int) -> int | None:
        at = start + len(TOOL_CALLS)
        while at < len(text) and text[at].isspace():
            at += 1
        try:
            _, end = _DECODER.raw_decode(text, at)
        except json.JSONDecodeError:
            return None  # incomplete (or not JSON: finish() reports it)
        return end

    def parse_call(self, call_text: str, tools: Sequence[FunctionTool] = ()) -> ParsedCall | None:
        calls = self.parse_calls(call_text, tools)
        return calls[0] if calls else None

    def parse_calls(self, call_text: str, tools: Sequence[FunctionTool] = ()) -> list[ParsedCall]:
        try:
            value = json.loads(call_text.removeprefix(TOOL_CALLS))
        except json.JSONDecodeError:
            return []
        items = value if isinstance(value, list) else [value]
        calls = []
        for item in items:
            if not isinstance(item, dict) or not isinstance(item.get("name"), str):
                return []
            arguments = _arguments(item.get("arguments", {}))
            if arguments is None:
                return []
            call_id = item.get("id")
            valid_id = isinstance(call_id, str) and _ID.fullmatch(call_id)
            calls.append(ParsedCall(item["name"], arguments, call_id if valid_id else None))
        return calls


MISTRAL_NEMO = register_format(MistralNemoFormat())
