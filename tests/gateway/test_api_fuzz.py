"""A bounded schemathesis pass (benchmarks.api_fuzz, which runs the long one) over the served
OpenAPI schema against the live gateway: every operation that generates text (chat and text
completions, Responses, Messages), with bodies the schema admits and bodies it forbids, gets
no 5xx, every 4xx in its surface's envelope, and no stream ending in an internal error.

Reproducible: seeded, so the same code draws the same cases. Cheap: at most 2 output tokens a
case (the benchmark's ``map_body`` hook), so the time goes to the inputs, not decoding.
"""

from __future__ import annotations

import pytest

from benchmarks import api_fuzz as bench

pytestmark = pytest.mark.slow

EXAMPLES = 12  # per operation and generation mode: 96 cases, ~35 s on 2 busy cores
REQUEST_MODELS = {
    "/v1/chat/completions": "ChatCompletionRequest",
    "/v1/completions": "CompletionRequest",
    "/v1/responses": "ResponsesRequest",
    "/v1/messages": "MessagesRequest",
    "/v1/messages/count_tokens": "CountTokensRequest",
}


def test_the_schema_carries_every_surfaces_request_body(client):
    """The fuzz can only draw what the schema describes: each surface's request model is its
    route's required JSON body, and the Messages content blocks are all in it."""
    spec = client.get("/openapi.json").json()
    for path, model in REQUEST_MODELS.items():
        body = spec["paths"][path]["post"]["requestBody"]
        assert body["required"] is True, path
        assert body["content"]["application/json"]["schema"] == {
            "$ref": f"#/components/schemas/{model}"}, path
        assert spec["components"]["schemas"][model]["properties"], model
    content = spec["components"]["schemas"]["Message"]["properties"]["content"]["anyOf"]
    (blocks,) = [branch["items"] for branch in content if branch.get("type") == "array"]
    assert set(blocks["discriminator"]["mapping"]) == {
        "text", "tool_use", "tool_result", "thinking", "redacted_thinking"}


def test_no_generated_input_gets_a_5xx(gateway):
    figures = bench.fuzz(gateway.open_url, gateway.model,
                         bench.FuzzSettings(max_examples=EXAMPLES, seed=0), paths=bench.GENERATES)
    bench.print_report(figures)  # shown with -s, and on failure
    assert {(f.operation.split()[1], f.mode) for f in figures} == {
        (path, mode) for path in bench.GENERATES for mode in bench.MODES}
    for f in figures:
        assert f.cases == EXAMPLES, (f.operation, f.mode, f.cases)
        assert f.failures == 0, f"{f.operation} ({f.mode}): {f.statuses}\n{f.first_failure}"
    # bodies the schema admits reach the engine on every surface, not only its validation
    # (most are refused for what a schema cannot say: a user turn without content, ...)
    for surface in (bench.GENERATES[:2], ("/v1/responses",), ("/v1/messages",)):
        answered = sum(f.statuses[200] for f in figures
                       if f.operation.split()[1] in surface and f.mode == "positive")
        assert answered >= 1, (surface, [(f.operation, f.mode, f.statuses) for f in figures])
