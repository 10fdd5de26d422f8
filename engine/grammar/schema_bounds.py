"""Cheap, up-front bounds on a JSON schema, before anything compiles it.

A constrained row is forced through its grammar token by token, and its speculative drafts ask
xgrammar for the text the grammar forces next (``find_jump_forward_tokens``). A schema whose
required recursion admits no finite value (``{"properties": {"a": {"$ref": "#"}},
"required": ["a"]}``) forces ``{"a": {"a": {"a": ...`` forever: that call never returns and
grows until the process is killed. A schema whose smallest value is gigantic (``minItems`` on
nested arrays) does the same in finite but unaffordable time. Both are decided here, by the
length of the shortest canonical JSON value each schema node admits, a least fixed point over
the schema graph (``$ref`` edges included): infinite means no finite value.

The other limits cap what makes compilation itself explode (enumerated values, counted
repetition, regex patterns); the compile worker (isolated.py) bounds whatever slips past them
in time and memory.

The length is a lower bound on what xgrammar's canonical JSON writes (``", "`` and ``": "``
separators): numbers count one character, patterns and formats are not read. A schema this
module accepts may still fail to compile; one it rejects admits no value shorter than the
limit, so nothing a client could have received is lost.
"""

from __future__ import annotations

import json
import math
from collections import deque
from dataclasses import dataclass
from typing import Any

from prefixgate.engine.api import InvalidRequestError

INFINITE = math.inf


@dataclass(frozen=True, slots=True)
class SchemaLimits:
    """What one JSON schema may ask of the grammar compiler.

    Attributes:
        max_shortest_chars: the shortest value the schema admits may be at most this long (a
            value that never fits a context is an output no request can finish).
        max_count: ``minItems``/``maxItems``/``minLength``/``maxLength``/``minProperties``/
            ``maxProperties``/``minContains``/``maxContains`` at most this (counted repetition is
            unrolled by the compiler).
        max_enum_values: ``enum`` entries summed over the whole schema.
        max_pattern_chars: the length of one ``pattern``/``propertyNames`` regex.
        max_nodes: schema nodes (objects) in the whole schema.
    """

    max_shortest_chars: int = 1 << 18
    max_count: int = 100_000
    max_enum_values: int = 4096
    max_pattern_chars: int = 1024
    max_nodes: int = 20_000


DEFAULT_LIMITS = SchemaLimits()

_COUNT_KEYWORDS = ("minItems", "maxItems", "minLength", "maxLength", "minProperties",
                   "maxProperties", "minContains", "maxContains")
# keywords whose value is one subschema / a list of them / a name → subschema map
_ONE = ("items", "additionalProperties", "contains", "not", "if", "then", "else",
        "propertyNames", "unevaluatedProperties", "unevaluatedItems", "additionalItems")
_MANY = ("anyOf", "oneOf", "allOf", "prefixItems")
_MAP = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")
# node evaluations the fixed point may take (an acyclic schema takes one per node; recursion
# adds its cycle's nodes each time a value on it drops)
_MAX_EVALUATIONS = 200_000
_SCALAR_CHARS = {"string": 2, "integer": 1, "number": 1, "boolean": 4, "null": 4}


def check_schema_bounds(schema: Any, param: str, limits: SchemaLimits = DEFAULT_LIMITS) -> None:
    """Reject ``schema`` up front if no finite value satisfies it, if its shortest value is
    over the limit, or if it asks the compiler for more than ``limits`` allow.

    Args:
        schema: a parsed JSON schema (dict or bool).
        param: the request field it came from (named in the error).
        limits: the bounds to apply.

    Raises:
        InvalidRequestError: ``code`` ``schema_unsatisfiable`` (no finite value, or none short
            enough) or ``schema_too_complex`` (a limit), the message naming what and where.
    """
    nodes = _collect(schema, param, limits)
    try:
        shortest = _shortest_chars(schema, nodes, limits.max_shortest_chars)
    except RecursionError as exc:
        raise _too_complex(str(exc), param) from exc
    if shortest == INFINITE:
        raise InvalidRequestError(
            "the schema admits no finite value (a required property or minItems leads back to "
            "the schema itself through $ref with no way out, or a required part is `false`/an "
            "empty enum); make the recursion optional", param=param, code="schema_unsatisfiable")
    if shortest > limits.max_shortest_chars:
        raise InvalidRequestError(
            f"the shortest value the schema admits is over {limits.max_shortest_chars} "
            "characters (minItems/minLength/required properties multiply through nesting)",
            param=param, code="schema_unsatisfiable")


def has_regex(schema: Any) -> bool:
    """Whether any subschema carries a regex (``pattern``, ``patternProperties``,
    ``propertyNames``). A regex can force text without end (``a*[^\\s\\S]`` allows only
    ``a`` forever), which the shortest-value bound does not read."""
    seen: set[int] = set()
    stack = [schema]
    while stack:
        node = stack.pop()
        if not isinstance(node, dict) or id(node) in seen:
            continue
        seen.add(id(node))
        if any(key in node for key in ("pattern", "patternProperties", "propertyNames")):
            return True
        stack.extend(_children(node))
    return False


def _too_complex(message: str, param: str) -> InvalidRequestError:
    return InvalidRequestError(message, param=param, code="schema_too_complex")


def _children(node: dict[str, Any]) -> list[Any]:
    out: list[Any] = []
    for key in _ONE:
        if isinstance(node.get(key), dict | bool):
            out.append(node[key])
    for key in _MANY:
        if isinstance(node.get(key), list):
            out.extend(node[key])
    for key in _MAP:
        if isinstance(node.get(key), dict):
            out.extend(node[key].values())
    if isinstance(node.get("items"), list):  # draft-4 tuple form
        out.extend(node["items"])
    return [child for child in out if isinstance(child, dict | bool)]


def _collect(schema: Any, param: str, limits: SchemaLimits) -> list[dict[str, Any]]:
    """Every schema object reachable from ``schema`` (iteratively), checking the count limits."""
    nodes: list[dict[str, Any]] = []
    seen: set[int] = set()
    stack = [schema]
    enum_values = 0
    while stack:
        node = stack.pop()
        if not isinstance(node, dict) or id(node) in seen:
            continue
        seen.add(id(node))
        nodes.append(node)
        if len(nodes) > limits.max_nodes:
            raise _too_complex(f"the schema has more than {limits.max_nodes} subschemas", param)
        for key in _COUNT_KEYWORDS:
            value = node.get(key)
            if isinstance(value, int | float) and not isinstance(value, bool) \
                    and value > limits.max_count:
                raise _too_complex(f"{key} {value} is over the limit of {limits.max_count}", param)
        if isinstance(node.get("enum"), list):
            enum_values += len(node["enum"])
            if enum_values > limits.max_enum_values:
                raise _too_complex(f"the schema's enum lists hold more than "
                                   f"{limits.max_enum_values} values in all", param)
        pattern = node.get("pattern")
        if isinstance(pattern, str) and len(pattern) > limits.max_pattern_chars:
            raise _too_complex(f"a pattern is {len(pattern)} characters; at most "
                               f"{limits.max_pattern_chars}", param)
        stack.extend(_children(node))
    return nodes


def _resolve(root: Any, ref: Any) -> Any:
    """The node a local ``$ref`` (``#``, ``#/$defs/x``, ``#/properties/a/items``) points at;
    None for anything else (the compiler reports those)."""
    if not isinstance(ref, str) or not ref.startswith("#"):
        return None
    node = root
    for part in (p for p in ref[1:].split("/") if p):
        part = part.replace("~1", "/").replace("~0", "~")
        if isinstance(node, dict):
            node = node.get(part)
        elif isinstance(node, list) and part.isdigit() and int(part) < len(node):
            node = node[int(part)]
        else:
            return None
    return node if isinstance(node, dict | bool) else None


def _shortest_chars(root: Any, nodes: list[dict[str, Any]], cap: float) -> float:
    """The least fixed point of "shortest value" over the schema graph.

    Every node starts at infinity and only decreases. Nodes are evaluated children first (a
    post-order of the graph, ``$ref`` edges included), so an acyclic schema settles with one
    evaluation per node; a node whose value drops puts the nodes that read it back on the work
    list, so recursion costs evaluations only around its cycle. Values past ``cap`` are clipped
    to ``cap + 1`` (the answer is only compared with the cap); infinity stays infinity: no finite
    value.

    Raises:
        RecursionError: over ``_MAX_EVALUATIONS`` (a recursion too intricate to bound cheaply).
    """
    value: dict[int, float] = {id(node): INFINITE for node in nodes}
    order, readers = _post_order(root, nodes)

    def of(node: Any) -> float:
        if node is True:
            return 1
        if node is False or node is None:
            return INFINITE
        return value.get(id(node), INFINITE)

    queue = deque(order)
    queued = {id(node) for node in order}
    evaluations = 0
    while queue:
        node = queue.popleft()
        queued.discard(id(node))
        evaluations += 1
        if evaluations > _MAX_EVALUATIONS:
            raise RecursionError("the schema's recursion is too intricate to bound")
        new = _node_chars(node, root, of)
        new = new if new == INFINITE else min(new, cap + 1)
        if new < value[id(node)]:
            value[id(node)] = new
            for reader in readers.get(id(node), ()):
                if id(reader) not in queued:
                    queued.add(id(reader))
                    queue.append(reader)
    return of(root)


def _post_order(root: Any, nodes: list[dict[str, Any]]
                ) -> tuple[list[dict[str, Any]], dict[int, list[dict[str, Any]]]]:
    """Nodes with their children (and ``$ref`` targets) before them, iteratively; and for each
    node, the nodes whose value reads it."""
    order: list[dict[str, Any]] = []
    readers: dict[int, list[dict[str, Any]]] = {}
    done: set[int] = set()
    for start in [root, *nodes]:
        if not isinstance(start, dict) or id(start) in done:
            continue
        stack: list[tuple[dict[str, Any], bool]] = [(start, False)]
        while stack:
            node, expanded = stack.pop()
            if expanded:
                order.append(node)
                continue
            if id(node) in done:
                continue
            done.add(id(node))
            stack.append((node, True))
            successors = [child for child in _children(node) if isinstance(child, dict)]
            target = _resolve(root, node.get("$ref"))
            if isinstance(target, dict):
                successors.append(target)
            for child in successors:
                readers.setdefault(id(child), []).append(node)
                if id(child) not in done:
                    stack.append((child, False))
    return order, readers


def _node_chars(node: dict[str, Any], root: Any, of: Any) -> float:
    """Shortest value of one node given its successors' current values."""
    if "const" in node:
        return len(json.dumps(node["const"]))
    if isinstance(node.get("enum"), list):
        return min((len(json.dumps(v)) for v in node["enum"]), default=INFINITE)
    parts: list[float] = []  # every one must hold (allOf-like): the largest is a lower bound
    if "$ref" in node:
        target = _resolve(root, node["$ref"])
        parts.append(of(target) if target is not None else 1)
    if isinstance(node.get("allOf"), list):
        parts.extend(of(s) for s in node["allOf"])
    for key in ("anyOf", "oneOf"):
        if isinstance(node.get(key), list):
            parts.append(min((of(s) for s in node[key]), default=INFINITE))
    parts.append(_typed_chars(node, of))
    return max(parts)


def _types(node: dict[str, Any]) -> list[str]:
    declared = node.get("type")
    if isinstance(declared, str):
        return [declared]
    if isinstance(declared, list):
        return [t for t in declared if isinstance(t, str)]
    if any(k in node for k in ("properties", "required", "additionalProperties")):
        return ["object"]
    if any(k in node for k in ("items", "prefixItems", "minItems")):
        return ["array"]
    if "minLength" in node or "pattern" in node:
        return ["string"]
    return []


def _typed_chars(node: dict[str, Any], of: Any) -> float:
    types = _types(node)
    if not types:
        return 1 if "type" not in node else INFINITE  # "type": [] admits nothing
    return min(_one_type_chars(node, t, of) for t in types)


def _count(node: dict[str, Any], key: str) -> int:
    value = node.get(key, 0)
    return int(value) if isinstance(value, int | float) and not isinstance(value, bool) \
        and math.isfinite(value) and value > 0 else 0


def _one_type_chars(node: dict[str, Any], kind: str, of: Any) -> float:
    if kind == "string":
        return 2 + _count(node, "minLength")
    if kind == "array":
        return _array_chars(node, of)
    if kind == "object":
        return _object_chars(node, of)
    return _SCALAR_CHARS.get(kind, INFINITE)


def _array_chars(node: dict[str, Any], of: Any) -> float:
    prefix = node.get("prefixItems")
    if not isinstance(prefix, list):
        prefix = node["items"] if isinstance(node.get("items"), list) else []
    items = node.get("items") if isinstance(node.get("items"), dict | bool) else True
    needed = _count(node, "minItems")
    total = 2.0 + 2.0 * max(0, needed - 1)  # brackets, ", " separators
    for i in range(needed):
        total += of(prefix[i]) if i < len(prefix) else of(items)
        if total == INFINITE:
            break
        if i >= len(prefix):  # the rest are all `items`: multiply instead of looping
            total += of(items) * (needed - i - 1)
            break
    return total


def _object_chars(node: dict[str, Any], of: Any) -> float:
    properties = node.get("properties") if isinstance(node.get("properties"), dict) else {}
    required = node.get("required") if isinstance(node.get("required"), list) else []
    extra = node.get("additionalProperties", True)
    total = 2.0 + 2.0 * max(0, len(required) - 1)
    for name in dict.fromkeys(r for r in required if isinstance(r, str)):
        schema = properties.get(name, extra if isinstance(extra, dict | bool) else True)
        total += len(json.dumps(name)) + 2 + of(schema)  # "name": value
    return total
