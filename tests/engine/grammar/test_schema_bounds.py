"""engine/grammar/schema_bounds.py: schemas no finite value satisfies, or whose smallest
value is huge, are refused before compiling; the shortest-value figure is a true lower bound."""

from __future__ import annotations

import json

import jsonschema
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from prefixgate.engine.api import InvalidRequestError
from prefixgate.engine.grammar.schema_bounds import (
    DEFAULT_LIMITS,
    SchemaLimits,
    _collect,
    _shortest_chars,
    check_schema_bounds,
    has_regex,
)

# the request of issue 37: it grew the server to 23 GB
RECURSIVE = {"type": "object", "properties": {"a": {"$ref": "#"}}, "required": ["a"]}


def shortest(schema) -> float:
    return _shortest_chars(schema, _collect(schema, "p", DEFAULT_LIMITS),
                           DEFAULT_LIMITS.max_shortest_chars)


def refused(schema, limits: SchemaLimits = DEFAULT_LIMITS) -> InvalidRequestError:
    with pytest.raises(InvalidRequestError) as info:
        check_schema_bounds(schema, "tools[0].function.parameters", limits)
    assert info.value.param == "tools[0].function.parameters"
    return info.value


@pytest.mark.parametrize("schema", [
    RECURSIVE,
    {"type": "array", "items": {"$ref": "#"}, "minItems": 1},
    {"$defs": {"node": {"type": "object", "properties": {"next": {"$ref": "#/$defs/node"}},
                        "required": ["next"]}},
     "type": "object", "properties": {"head": {"$ref": "#/$defs/node"}}, "required": ["head"]},
    {"definitions": {"a": {"$ref": "#/definitions/b"}, "b": {"allOf": [{"$ref": "#/definitions/a"}]}},
     "$ref": "#/definitions/a"},
    {"type": "object", "properties": {"x": {"enum": []}}, "required": ["x"]},
    {"type": "object", "properties": {"x": False}, "required": ["x"]},
    {"type": "object", "additionalProperties": False, "required": ["undeclared"]},
    {"anyOf": [RECURSIVE, {"type": "array", "items": {"$ref": "#"}, "minItems": 2}]},
])
def test_a_schema_no_finite_value_satisfies_is_refused(schema):
    error = refused(schema)
    assert error.code == "schema_unsatisfiable" and "no finite value" in error.message


@pytest.mark.parametrize("schema", [
    {"type": "object", "properties": {"a": {"$ref": "#"}}},  # optional recursion: {} ends it
    {"type": "array", "items": {"$ref": "#"}},  # [] ends it
    {"anyOf": [RECURSIVE, {"type": "null"}]},  # a way out
    {"$defs": {"tree": {"type": "object", "properties": {
        "value": {"type": "integer"},
        "children": {"type": "array", "items": {"$ref": "#/$defs/tree"}}},
        "required": ["value", "children"]}}, "$ref": "#/$defs/tree"},
    {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
])
def test_recursion_with_a_way_out_is_accepted(schema):
    check_schema_bounds(schema, "p")
    assert shortest(schema) < 64


def test_a_smallest_value_past_the_limit_is_refused_with_the_limit_named():
    nested = {"type": "array", "minItems": 1000,
              "items": {"type": "array", "items": {"const": 1}, "minItems": 1000}}
    assert shortest(nested) > DEFAULT_LIMITS.max_shortest_chars  # a million elements
    error = refused(nested)
    assert error.code == "schema_unsatisfiable"
    assert str(DEFAULT_LIMITS.max_shortest_chars) in error.message
    check_schema_bounds({**nested, "minItems": 10, "items": {**nested["items"], "minItems": 10}},
                        "p")


@pytest.mark.parametrize(("schema", "needle"), [
    ({"type": "string", "maxLength": 10**9}, "maxLength"),
    ({"type": "array", "minItems": 10**7}, "minItems"),
    ({"enum": list(range(5000))}, "enum"),
    ({"type": "object", "properties": {f"p{i}": {"enum": list(range(50))} for i in range(100)}},
     "enum"),
    ({"type": "string", "pattern": "a" * 2000}, "pattern"),
])
def test_what_makes_compilation_explode_is_capped(schema, needle):
    error = refused(schema)
    assert error.code == "schema_too_complex" and needle in error.message


def test_too_many_subschemas_are_refused():
    wide = {"type": "object", "properties": {f"p{i}": {"type": "integer"} for i in range(30)}}
    error = refused(wide, SchemaLimits(max_nodes=20))
    assert error.code == "schema_too_complex" and "20 subschemas" in error.message


def test_a_long_reference_chain_is_bounded_quickly():
    # 3,000 definitions each requiring the next, the last one with a way out: one evaluation
    # per node, not one pass per link
    defs = {f"d{i}": {"type": "object", "properties": {"n": {"$ref": f"#/$defs/d{i + 1}"}},
                      "required": ["n"]} for i in range(3000)}
    defs["d3000"] = {"anyOf": [{"$ref": "#/$defs/d0"}, {"type": "null"}]}
    schema = {"$defs": defs, "$ref": "#/$defs/d0"}
    assert shortest(schema) == 3000 * len('{"n": }') + len("null")
    defs["d3000"] = {"$ref": "#/$defs/d0"}  # and without one
    assert refused(schema).code == "schema_unsatisfiable"


def test_regexes_are_found_anywhere():
    assert not has_regex(RECURSIVE)
    assert has_regex({"type": "object", "properties": {"a": {"type": "array", "items": {
        "type": "string", "pattern": "a*"}}}})
    assert has_regex({"$defs": {"k": {"patternProperties": {"^x": {}}}}})
    assert has_regex({"anyOf": [{"type": "object", "propertyNames": {"maxLength": 3}}]})


# --- the bound is a lower bound: a schema and a value it admits, built together -------------

def _canonical(value) -> str:
    return json.dumps(value)  # ", " and ": " separators, as xgrammar's canonical JSON


_leaf = st.one_of(
    st.integers(-1000, 1000).map(lambda v: ({"type": "integer"}, v)),
    st.booleans().map(lambda v: ({"type": "boolean"}, v)),
    st.just(({"type": "null"}, None)),
    st.tuples(st.integers(0, 6), st.integers(0, 4)).map(
        lambda t: ({"type": "string", "minLength": t[0]}, "x" * (t[0] + t[1]))),
    st.lists(st.sampled_from(["a", "bb", "ccc"]), min_size=1, max_size=3, unique=True).flatmap(
        lambda options: st.sampled_from(options).map(lambda v: ({"enum": options}, v))),
)


def _extend(children):
    def as_object(pairs):
        properties = {f"k{i}": schema for i, (schema, _) in enumerate(pairs)}
        return st.lists(st.booleans(), min_size=len(pairs), max_size=len(pairs)).map(
            lambda required: (
                {"type": "object", "properties": properties,
                 "required": [f"k{i}" for i, r in enumerate(required) if r]},
                {f"k{i}": value for i, (_, value) in enumerate(pairs)
                 if required[i] or i % 2 == 0}))

    def as_array(pair, extra):
        schema, value = pair
        return ({"type": "array", "items": schema, "minItems": extra}, [value] * (extra + 1))

    def as_any_of(pairs):
        return st.integers(0, len(pairs) - 1).map(
            lambda i: ({"anyOf": [schema for schema, _ in pairs]}, pairs[i][1]))

    return st.one_of(
        st.lists(children, min_size=1, max_size=3).flatmap(as_object),
        st.tuples(children, st.integers(0, 3)).map(lambda t: as_array(*t)),
        st.lists(children, min_size=1, max_size=3).flatmap(as_any_of),
    )


schema_and_value = st.recursive(_leaf, _extend, max_leaves=12)


@settings(max_examples=200, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.too_slow])
@given(schema_and_value)
def test_the_shortest_value_is_never_longer_than_a_value_the_schema_admits(pair):
    schema, value = pair
    jsonschema.validate(value, schema)  # the generator's own claim
    assert shortest(schema) <= len(_canonical(value))
    check_schema_bounds(schema, "p")  # and so it is never refused
