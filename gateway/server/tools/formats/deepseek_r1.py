"""DeepSeek R1 (and its Qwen / Llama distills): calls in a block of special markers.

    <｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>NAME
    ```json
    ARGS
    ```<｜tool▁call▁end｜>
    <｜tool▁call▁begin｜>...<｜tool▁call▁end｜><｜tool▁calls▁end｜>

The grammar writes one call per block (a second call opens a new block, so a parallel call's
re-rendered history differs from what was generated); the parser reads every call of a block.
"""

from __future__ import annotations

import json
import re
from collections.abc import Sequence

from prefixgate.gateway.server.tools.formats.base import ParsedCall, ToolCallFormat
from prefixgate.gateway.server.tools.formats.registry import register_format
from prefixgate.gateway.server.tools.records import FunctionTool

CALLS_BEGIN = "<｜tool▁calls▁begin｜>"
CALLS_END = "<｜tool▁calls▁end｜>"
CALL_BEGIN = "<｜tool▁call▁begin｜>"
CALL_END = "<｜tool▁call▁end｜>"
_CALL = re.compile(
    re.escape(CALL_BEGIN) + r"function<｜tool▁sep｜>([^\n]+)\n```(?:json)?\n(.*?)\n?```"
    + re.escape(CALL_END),
    re.DOTALL,
)


class DeepSeekR1Format(ToolCallFormat):
    name = "deepseek_r1"
    trigger = CALLS_BEGIN
    end = f"\n```{CALL_END}{CALLS_END}"

    def detect(self, template: str) -> bool:
        return CALL_BEGIN in template

    def begin(self, tool_name: str) -> str:
        return f"{CALLS_BEGIN}{CALL_BEGIN}function<｜tool▁sep｜>{tool_name}\n```json\n"

    def find_call(self, text: str, start: int) -> int | None:
        close = text.find(CALLS_END, start)
        return None if close < 0 else close + len(CALLS_END)

    def parse_call(self, call_text: str, tools: Sequence[FunctionTool] = ()) -> ParsedCall | None:
        calls = self.parse_calls(call_text, tools)
        return calls[0] if calls else None

    def parse_calls(self, call_text: str, tools: Sequence[FunctionTool] = ()) -> list[ParsedCall]:
        calls = []
        for name, arguments in _CALL.findall(call_text):
            try:
                value = json.loads(arguments)
            except json.JSONDecodeError:
                return []
            calls.append(ParsedCall(name.strip(), json.dumps(value, ensure_ascii=False)))
        return calls


DEEPSEEK_R1 = register_format(DeepSeekR1Format())
