"""``tool_choice`` and ``response_format`` → one :class:`GrammarSpec` for the engine.

Tool calls use xgrammar structural tags in the served model's format (tools/formats, chosen
by tools/dialect.py); by default the gateway's own format of tools/prompt.py, where each
function is a tag: ``<tool_call>\\n{"name": NAME, "arguments": `` + its parameters' canonical
JSON + ``}\\n</tool_call>``.

| tool_choice | grammar |
|---|---|
| auto | free text; once ``<tool_call>`` starts, a valid call of one of the functions |
| required | calls only, at least one |
| function | exactly one call, of that function |
| none | no tool grammar (``response_format`` alone) |

``parallel_tool_calls=false`` stops after the first call. ``auto`` with a JSON
``response_format`` is "the JSON answer, or calls"; a forced call (required, function) with
one is the call alone (the forced call wins, as on OpenAI).
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from typing import Any

from prefixgate.engine.api import GrammarSpec, InvalidRequestError
from prefixgate.engine.grammar import json_schema_ebnf
from prefixgate.engine.grammar.schema_bounds import check_schema_bounds, has_regex
from prefixgate.engine.grammar.scoped_cache import ScopedLRUCache
from prefixgate.engine.grammar.worker_pool import short_error
from prefixgate.gateway.server.tools.prompt import (
    CALL_END,
    CALL_SEPARATOR,
    TOOL_CALL_OPEN,
    call_begin,
)
from prefixgate.gateway.server.tools.records import FunctionTool, ToolChoice

# Nesting of JSON containers a schema may have: deeper ones are refused before any converter
# recurses through them (a 300-level schema would exhaust a recursive converter's stack).
MAX_SCHEMA_DEPTH = 32
MAX_SCHEMA_CHARS = 256 * 1024
# schema → EBNF conversions kept, in bytes of EBNF text; one tenant at most half
EBNF_CACHE_BYTES = 64 << 20


def schema_depth(value: Any, limit: int = MAX_SCHEMA_DEPTH) -> int:
    """Container nesting depth of a JSON value, walked iteratively; stops counting past limit."""
    deepest, stack = 0, [(value, 1)]
    while stack:
        node, depth = stack.pop()
        if isinstance(node, dict | list):
            deepest = max(deepest, depth)
            if deepest > limit:
                return deepest
            children = node.values() if isinstance(node, dict) else node
            stack.extend((child, depth + 1) for child in children if isinstance(child, dict | list))
    return deepest


def check_schema(schema: Any, param: str, *, object_only: bool) -> str:
    """Bound and sanity-check a JSON schema; returns its JSON text (key order kept)."""
    if not isinstance(schema, dict):
        raise InvalidRequestError("a JSON schema must be an object", param=param)
    if object_only and schema.get("type", "object") != "object":
        raise InvalidRequestError(
            f"function parameters must be an object schema (type 'object'), got type "
            f"{schema.get('type')!r}", param=param)
    if schema_depth(schema) > MAX_SCHEMA_DEPTH:
        raise InvalidRequestError(
            f"the schema nests deeper than {MAX_SCHEMA_DEPTH} levels", param=param)
    text = json.dumps(schema, ensure_ascii=False)
    if len(text) > MAX_SCHEMA_CHARS:
        raise InvalidRequestError(
            f"the schema is {len(text)} characters; at most {MAX_SCHEMA_CHARS}", param=param)
    return text


_EBNF_CACHE: ScopedLRUCache[str] = ScopedLRUCache(EBNF_CACHE_BYTES)


def _ebnf(schema_text: str, strict: bool, scope: str, param: str) -> str:
    # NOTE: cached per scope (tenant): a warm conversion is faster than a cold one, and a shared
    # cache would let one tenant time whether another one sent a schema. Bounded in bytes: a
    # flood of distinct schemas evicts, and one tenant's flood only its own entries past half.
    # The converter walks the schema once; a swarm repeats its schemas, so this is warm after
    # the first request (the compiled grammar is cached again by the engine). The bounds are
    # checked on a miss only: a cached schema passed them.
    cached = _EBNF_CACHE.get(scope, (schema_text, strict))
    if cached is None:
        schema = json.loads(schema_text)
        check_schema_bounds(schema, param)
        cached = json_schema_ebnf(schema, strict=strict)
        _EBNF_CACHE.put(scope, (schema_text, strict), cached, len(cached) + len(schema_text))
    return cached


def schema_grammar(schema: Any, param: str, *, strict: bool = True, object_only: bool = False,
                   scope: str = "") -> str:
    """The canonical-JSON EBNF of ``schema`` (cached); a 400 naming ``param`` if it is bad
    (engine/grammar/schema_bounds.py: no finite value, or over a limit). Call it off the event
    loop: a cold conversion walks the whole schema."""
    text = check_schema(schema, param, object_only=object_only)
    try:
        return _ebnf(text, strict, scope, param)
    except (RuntimeError, ValueError, TypeError, RecursionError) as exc:
        raise InvalidRequestError(
            f"the schema cannot be compiled into a grammar: "
            f"{short_error(str(exc) or type(exc).__name__)}",
            param=param, code="invalid_grammar") from exc


def _format_of(spec: GrammarSpec, scope: str) -> dict[str, Any]:
    """A response_format grammar as a structural-tag element (JSON kinds only)."""
    if spec.kind == "json_schema":
        return {"type": "grammar", "grammar": schema_grammar(
            json.loads(spec.source), spec.param, strict=spec.strict, scope=scope)}
    if spec.kind == "json_object":
        return {"type": "grammar", "grammar": schema_grammar(
            {"type": "object"}, spec.param, strict=False, scope=scope)}
    raise InvalidRequestError(
        f"response_format {spec.kind!r} cannot be combined with tools (json_schema and "
        "json_object can)", param=spec.param)


def _json_content(tool: FunctionTool, param: str, scope: str) -> dict[str, Any]:
    """A call's arguments as canonical JSON of the tool's schema (a structural-tag element)."""
    return {"type": "grammar", "grammar": schema_grammar(
        tool.schema, param, strict=tool.strict, object_only=True, scope=scope)}  # fmt: skip


class _Hermes:
    """The gateway's own call format (tools/prompt.py); tools/formats/hermes.py writes the same."""

    trigger, end, separator, block = TOOL_CALL_OPEN, CALL_END, CALL_SEPARATOR, None
    begin = staticmethod(call_begin)
    content = staticmethod(_json_content)


def tool_grammar(
    tools: Sequence[FunctionTool],
    choice: ToolChoice,
    response_format: GrammarSpec | None,
    parameters_param: Callable[[int], str],
    scope: str = "",
    fmt: Any = None,
) -> GrammarSpec | None:
    """The grammar of a request's output given its tools, tool choice and response format.

    Args:
        tools: every tool the request declared.
        choice: the (validated) tool choice; ``function`` names one of ``tools``.
        response_format: the JSON grammar asked for the text answer, if any.
        parameters_param: the request field of tool i's schema (for errors).
        scope: the tenant (caches are per tenant, see ``_ebnf``).
        fmt: the tool-call format calls are written in (a tools/formats ``ToolCallFormat``:
            ``begin(name)``, ``content(tool, param, scope)``, ``end``, ``separator``,
            ``trigger``, ``block``); None = the gateway's Hermes format.
    """
    if not tools or choice.mode == "none":
        return response_format
    fmt = fmt if fmt is not None else _Hermes
    if choice.mode != "auto":
        # the forced call wins over a JSON format (OpenAI accepts both; instructor sends both):
        # the output is the call, whose arguments follow the tool's schema
        response_format = None
    tags = [
        {"type": "tag", "begin": fmt.begin(tool.name),
         "content": fmt.content(tool, parameters_param(index), scope), "end": fmt.end}
        for index, tool in enumerate(tools)
        if choice.mode != "function" or tool.name == choice.name
    ]  # fmt: skip
    one_only = choice.mode == "function" or not choice.parallel
    calls_only: dict[str, Any] = {"type": "tags_with_separator", "tags": tags,
                                  "separator": fmt.separator, "at_least_one": True,
                                  "stop_after_first": one_only}
    if fmt.block is not None:  # one list holds every call: the list is the one tag
        calls_only = {"type": "tag", "begin": fmt.block[0], "content": calls_only,
                      "end": fmt.block[1]}
        tags, one_only = [calls_only], True
    if choice.mode != "auto":
        grammar: dict[str, Any] = calls_only
    elif response_format is not None:
        grammar = {"type": "or", "elements": [_format_of(response_format, scope), calls_only]}
    else:
        grammar = {"type": "triggered_tags", "triggers": [fmt.trigger], "tags": tags,
                   "at_least_one": False, "stop_after_first": one_only}
    source = json.dumps({"type": "structural_tag", "format": grammar}, ensure_ascii=False)
    # every schema in it passed check_schema_bounds (a finite shortest value); a regex can
    # still force text without end, so a grammar with one drafts without jump-forward
    schemas = [tool.schema for tool in tools]
    if response_format is not None and response_format.kind == "json_schema":
        schemas.append(json.loads(response_format.source))
    return GrammarSpec("structural_tag", source, param="tools",
                       forced_text_finite=not any(has_regex(schema) for schema in schemas))
