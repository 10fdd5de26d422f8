"""Tool-call formats, one module each (render by the template, grammar, parse); each registers
here. ``format_for_template`` picks the one a chat template teaches; a flag can override it.

    hermes        <tool_call>{"name", "arguments"}</tool_call>   Hermes, Qwen2.5, Qwen3
    qwen3_coder   <tool_call><function=..><parameter=..>          Qwen3-Coder, Qwen3.5
    llama3_json   {"name", "parameters"}                         Llama 3.1 / 3.2 / 3.3
    mistral       [TOOL_CALLS]NAME[ARGS]{json}                   Devstral, Mistral Small 3.2, Ministral 3
    mistral_nemo  [TOOL_CALLS][{"name", "arguments", "id"}, …]   Mistral Nemo
    deepseek_r1   <｜tool▁calls▁begin｜>…```json ARGS```…         DeepSeek R1 and its distills
    granite       <|tool_call|>[{"name", "arguments"}]           Granite 3.x
    harmony       <|start|>assistant to=functions.NAME<|channel|>commentary json<|message|>ARGS<|call|>
                  (analysis / final channels: reasoning / answer)  gpt-oss
"""

from __future__ import annotations

# every format module registers itself on import
from prefixgate.gateway.server.tools.formats import (  # noqa: F401
    deepseek_r1,
    granite,
    harmony,
    hermes,
    llama3_json,
    mistral,
    mistral_nemo,
    qwen3_coder,
)
from prefixgate.gateway.server.tools.formats.base import (
    FormatStreamParser,
    ParsedCall,
    ToolCallFormat,
)
from prefixgate.gateway.server.tools.formats.registry import (
    format_for_template,
    get_format,
    register_format,
    tool_call_formats,
)

__all__ = [
    "FormatStreamParser",
    "ParsedCall",
    "ToolCallFormat",
    "format_for_template",
    "get_format",
    "register_format",
    "tool_call_formats",
]
