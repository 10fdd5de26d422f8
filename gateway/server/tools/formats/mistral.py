"""Mistral (Devstral, Mistral Small 3.2, Ministral 3): ``[TOOL_CALLS]NAME[ARGS]{json}``.

Each call starts with ``[TOOL_CALLS]``; a call ends where its JSON arguments end. Mistral
Small 3.2's template also writes ``[CALL_ID]<9 alphanumerics>`` before ``[ARGS]`` in the
history: for that template (``for_template``) the grammar has the model write an id there too,
and the parser makes it the call's id, so the client sends it back and the next turn re-renders
exactly what was generated. These templates refuse any other id: ``history_messages`` maps a
client's ids onto 9 alphanumerics (``call_`` / ``toolu_`` prefixes dropped, else a hash), the
same way every turn. Mistral Nemo's older ``[TOOL_CALLS][{...}]`` list is a different format
(formats/mistral_nemo.py).
"""

from __future__ import annotations

import hashlib
import json
import re
import string
from collections.abc import Sequence
from typing import Any

from prefixgate.gateway.server.tools.formats.base import ParsedCall, ToolCallFormat
from prefixgate.gateway.server.tools.formats.registry import register_format
from prefixgate.gateway.server.tools.records import FunctionTool

_DECODER = json.JSONDecoder()
_HEADER = re.compile(r"\[TOOL_CALLS\]([^\[\]\s]+)(?:\[CALL_ID\]([A-Za-z0-9]*))?\[ARGS\]")
_ID = re.compile(r"[A-Za-z0-9]{9}")
_ID_ALPHABET = string.ascii_letters + string.digits


def history_call_id(call_id: str) -> str:
    """A call id as these templates take it: 9 alphanumerics, the same for the same id."""
    bare = call_id.removeprefix("call_").removeprefix("toolu_")
    if _ID.fullmatch(bare):
        return bare
    number = int.from_bytes(hashlib.sha256(call_id.encode()).digest()[:8], "big")
    return "".join(_ID_ALPHABET[(number >> (6 * i)) % len(_ID_ALPHABET)] for i in range(9))


def with_history_call_ids(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """``messages`` with every call id and tool result's ``tool_call_id`` as
    :func:`history_call_id` (Mistral's templates refuse any other id)."""
    out = []
    for message in messages:
        if message.get("tool_calls"):
            calls = [{**c, "id": history_call_id(str(c.get("id") or ""))}
                     for c in message["tool_calls"]]
            message = {**message, "tool_calls": calls}
        if message.get("role") == "tool" and message.get("tool_call_id") is not None:
            message = {**message, "tool_call_id": history_call_id(message["tool_call_id"])}
        out.append(message)
    return out


class MistralFormat(ToolCallFormat):
    name = "mistral"
    trigger = "[TOOL_CALLS]"
    end = ""  # the JSON object closes the call
    separator = ""

    def detect(self, template: str) -> bool:
        return "[TOOL_CALLS]" in template and "[ARGS]" in template

    call_ids = False  # the grammar writes [CALL_ID]<id> (Mistral Small 3.2's template)

    def for_template(self, template: str) -> ToolCallFormat:
        if "[CALL_ID]" in template and not self.call_ids:
            variant = MistralFormat()
            variant.call_ids = True
            return variant
        return self

    def begin(self, tool_name: str) -> str:
        return f"[TOOL_CALLS]{tool_name}" + ("[CALL_ID]" if self.call_ids else "[ARGS]")

    def content(self, tool: FunctionTool, param: str = "tools", scope: str = "") -> dict[str, Any]:
        arguments = super().content(tool, param, scope)
        if not self.call_ids:
            return arguments
        return {"type": "sequence", "elements": [
            {"type": "regex", "pattern": "[A-Za-z0-9]{9}"},
            {"type": "const_string", "value": "[ARGS]"}, arguments]}  # fmt: skip

    def history_messages(self, messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
        return with_history_call_ids(messages)

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
        return ParsedCall(header.group(1), json.dumps(arguments, ensure_ascii=False),
                          header.group(2) or None)


MISTRAL = register_format(MistralFormat())
