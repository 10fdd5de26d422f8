"""Tool calling shared by every API surface: neutral records (records.py), tools into the
prompt (prompt.py), tool_choice / response_format into one grammar (grammar.py), and the
generated text back into calls (parser.py); the model's own tool-call formats (formats/) and
the dialect a server speaks, chosen from its chat template (dialect.py), through which every
surface gets its prompt inputs, grammar and output parser. A surface translates its wire fields into
:class:`FunctionTool` / :class:`ToolChoice` and the parser's events back into its own format.
"""

from prefixgate.gateway.server.tools.grammar import schema_grammar, tool_grammar
from prefixgate.gateway.server.tools.parser import (
    CallArguments,
    CallEnd,
    CallStart,
    Event,
    ReasoningPiece,
    TextPiece,
    ToolCallParser,
    parse_output,
)
from prefixgate.gateway.server.tools.prompt import native_messages, prepare_messages
from prefixgate.gateway.server.tools.records import FunctionTool, ToolCallOutput, ToolChoice

__all__ = [
    "CallArguments",
    "CallEnd",
    "CallStart",
    "Event",
    "FunctionTool",
    "ReasoningPiece",
    "TextPiece",
    "ToolCallOutput",
    "ToolCallParser",
    "ToolChoice",
    "native_messages",
    "parse_output",
    "prepare_messages",
    "schema_grammar",
    "tool_grammar",
]
