"""Property-based fuzzing of every POST route's request body, from the live /openapi.json.

Bodies are drawn from each route's JSON schema (``from_schema`` below covers the subset FastAPI
emits: objects, anyOf, $ref, enums, bounded numbers and strings, arrays), then half of them get
one field replaced by an arbitrary JSON value (huge ints, NaN, deep nesting, wrong types, lone
surrogates and noncharacters in strings and keys). The
server must never answer 5xx, every 4xx carries an error envelope, and a stream never ends in
an internal error. Bounded: ``PREFIXGATE_FUZZ_SECONDS`` (default 45) of sending in all;
generation is kept to a few tokens so the budget goes to inputs, not decoding.
"""

from __future__ import annotations

import collections
import contextlib
import json
import os
import time

import httpx
import pytest
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st

pytestmark = pytest.mark.slow

BUDGET_S = float(os.environ.get("PREFIXGATE_FUZZ_SECONDS", "45"))
# cache administration changes what every later test sees (pins hold pages): not fuzzed here
SKIP = ("/v1/cache/",)
GENERATES = ("/v1/chat/completions", "/v1/completions", "/v1/responses", "/v1/messages")

# text a JSON body can carry (as \\u escapes) that is not valid Unicode text: lone surrogates
# and noncharacters, mixed with ordinary characters; every surface must answer it with a 400
HOSTILE_TEXT = st.lists(
    st.characters(categories=["Cs"]) | st.sampled_from(["\ufdd0", "\ufdef", "\ufffe", "\uffff",
                                                         "\U0001fffe", "\U0010ffff"])
    | st.characters(), min_size=1, max_size=6).map("".join)
TEXT = st.text(max_size=40) | HOSTILE_TEXT

JSON_VALUES = st.recursive(
    st.none() | st.booleans() | st.integers(min_value=-(2**70), max_value=2**70)
    | st.floats(allow_nan=True, allow_infinity=True) | TEXT,
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(TEXT, inner, max_size=4),
    max_leaves=12,
)


def _routes(spec: dict) -> list[tuple[str, dict]]:
    routes = []
    for path, ops in sorted(spec["paths"].items()):
        body = ops.get("post", {}).get("requestBody", {}).get("content", {}).get("application/json")
        if body and not path.startswith(SKIP):
            routes.append((path, {**body["schema"], "components": spec.get("components", {})}))
    return routes


def from_schema(schema: dict, root: dict | None = None, depth: int = 0) -> st.SearchStrategy:
    """A strategy for (mostly) valid instances of an OpenAPI 3.1 schema.

    (hypothesis-jsonschema would do this, but 0.23 breaks on hypothesis >= 6.13x internals.)
    """
    root = root or schema
    if "$ref" in schema:
        target = root["components"]["schemas"][schema["$ref"].rsplit("/", 1)[1]]
        return st.deferred(lambda: from_schema(target, root, depth + 1))
    if depth > 6:
        return st.none()
    for key in ("anyOf", "oneOf"):
        if key in schema:
            return st.one_of([from_schema(s, root, depth + 1) for s in schema[key]])
    if "allOf" in schema:
        return from_schema(schema["allOf"][0], root, depth + 1)
    if "const" in schema:
        return st.just(schema["const"])
    if "enum" in schema:
        return st.sampled_from(schema["enum"])
    kind = schema.get("type")
    if kind == "null":
        return st.none()
    if kind == "boolean":
        return st.booleans()
    if kind == "integer":
        low, high = schema.get("minimum"), schema.get("maximum")
        edges = [v for v in (low, high) if v is not None]
        edges += [v + 1 for v in edges] + [v - 1 for v in edges]  # the edges, both sides
        return st.integers(min_value=low, max_value=high) | st.sampled_from(edges or [0])
    if kind == "number":
        return st.floats(min_value=schema.get("minimum"), max_value=schema.get("maximum"),
                         allow_nan=False, allow_infinity=False)
    if kind == "string":
        low = schema.get("minLength", 0)
        high = min(schema.get("maxLength", low + 40), low + 40)
        if "pattern" in schema:
            return st.from_regex(schema["pattern"], fullmatch=True).filter(lambda s: len(s) <= high)
        return st.text(min_size=low, max_size=high) | HOSTILE_TEXT.map(lambda s: s.ljust(low, "a"))
    if kind == "array":
        items = from_schema(schema.get("items", {}), root, depth + 1)
        low = schema.get("minItems", 0)
        return st.lists(items, min_size=low, max_size=min(schema.get("maxItems", low + 3), low + 3))
    if kind == "object" or "properties" in schema:
        props = schema.get("properties", {})
        required = set(schema.get("required", ()))
        return st.fixed_dictionaries(
            {k: from_schema(v, root, depth + 1) for k, v in props.items() if k in required},
            optional={k: from_schema(v, root, depth + 1) for k, v in props.items() if k not in required},
        )
    return JSON_VALUES  # no type given: any JSON value


def _properties(schema: dict) -> dict:
    ref = schema.get("$ref", "")
    if ref.startswith("#/components/schemas/"):
        schema = schema["components"]["schemas"][ref.rsplit("/", 1)[1]]
    return schema.get("properties", {})


def _bounded(path: str, body: object) -> object:
    """Keep generation short: the fuzz is about the inputs, not about decoding."""
    if isinstance(body, dict) and path in GENERATES:
        for key in ("max_tokens", "max_completion_tokens", "max_output_tokens"):
            value = body.get(key)
            if value is None or (isinstance(value, int) and not isinstance(value, bool) and value > 4):
                body[key] = 2  # absent or null means "the rest of the context"
        if isinstance(body.get("n"), int) and isinstance(body.get("prompt"), list):
            body["prompt"] = body["prompt"][:4]  # n x prompts sequences
    return body


def _envelope_ok(response: httpx.Response) -> bool:
    try:
        body = response.json()
    except ValueError:
        return False
    error = body.get("error") if isinstance(body, dict) else None
    return isinstance(error, dict) and isinstance(error.get("message"), str) and bool(error["message"])


def test_fuzz_every_route(gateway):
    spec = httpx.get(f"{gateway.open_url}/openapi.json", timeout=30).json()
    routes = _routes(spec)
    assert any(p == "/v1/chat/completions" for p, _ in routes), [p for p, _ in routes]
    statuses: dict[str, collections.Counter] = collections.defaultdict(collections.Counter)
    failures: list[str] = []
    started = time.monotonic()
    share = BUDGET_S / len(routes)

    with httpx.Client(base_url=gateway.open_url, timeout=60) as client:
        for index, (path, schema) in enumerate(routes):
            fuzz_route(client, path, schema, started + share * (index + 1), statuses, failures)

    total = sum(sum(c.values()) for c in statuses.values())
    report = {path: dict(sorted(c.items(), key=str)) for path, c in statuses.items()}
    print(f"\nfuzz: {total} requests in {time.monotonic() - started:.0f} s: {json.dumps(report)}")
    assert total >= 10 * len(routes), report
    assert not failures, "\n".join(failures[:10])


def fuzz_route(client: httpx.Client, path: str, schema: dict, deadline: float,
               statuses: dict[str, collections.Counter], failures: list[str]) -> None:
    bodies = from_schema(schema)
    fields = sorted(_properties(schema))
    keys = st.sampled_from(fields) | st.text(min_size=1, max_size=24) if fields else st.text(min_size=1)
    mutated = st.tuples(bodies, keys, JSON_VALUES).map(
        lambda t: {**t[0], t[1]: t[2]} if isinstance(t[0], dict) else t[2])

    @settings(max_examples=400, deadline=None, database=None, derandomize=True, phases=[Phase.generate],
              suppress_health_check=list(HealthCheck))
    @given(body=st.one_of(bodies, mutated))
    def send(body) -> None:
        if time.monotonic() > deadline:
            # NOTE: returning would let hypothesis draw the rest of its 400 examples, which on
            # a loaded box spent the whole budget on the first routes
            raise _BudgetSpent
        body = _bounded(path, body)
        try:
            content = json.dumps(body, allow_nan=True).encode()
        except (ValueError, OverflowError):
            return
        try:
            response = client.post(path, content=content, headers={"content-type": "application/json"})
        except httpx.TimeoutException:
            statuses[path]["timeout"] += 1
            failures.append(f"timeout: {path} {content[:300]!r}")
            return
        statuses[path][response.status_code] += 1
        where = f"{path} {response.status_code} {content[:300]!r}: {response.text[:300]}"
        if response.status_code >= 500:
            failures.append(where)
        elif response.status_code >= 400 and not _envelope_ok(response):
            failures.append("no envelope: " + where)
        elif "text/event-stream" in response.headers.get("content-type", "") and (
                '"internal_error"' in response.text or '"api_error"' in response.text):
            failures.append("stream error: " + where)

    with contextlib.suppress(_BudgetSpent):  # the route's share of the budget is spent
        send()


class _BudgetSpent(Exception):
    """This route's share of the fuzzing budget is spent."""
