"""Constrained rows in the engine, on the real default model: every output matches its grammar,
greedy output is identical with prefix caching on/off, alone or in a busy batch, across
preemption and for every n > 1 choice; a dead-end grammar fails its request alone."""

from __future__ import annotations

import json

import jsonschema
import pytest

from prefixgate.engine.api import (
    GenerationRequest,
    GrammarSpec,
    InvalidRequestError,
    SamplingParams,
)
from tests.engine.test_engine import SYSTEM, TASKS, chat, run, tokens

SCHEMA = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "maxLength": 16},
        "days": {"type": "integer", "minimum": 1, "maximum": 14},
        "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
    },
    "required": ["city", "days", "unit"],
    "additionalProperties": False,
}
JSON = GrammarSpec("json_schema", json.dumps(SCHEMA))
LONG_SCHEMA = {  # an output of ~50 tokens: rows grow past their first pages
    "type": "object",
    "properties": {"digits": {"type": "array", "items": {"type": "integer", "minimum": 0,
                                                         "maximum": 9},
                              "minItems": 24, "maxItems": 24}},
    "required": ["digits"],
}


def text(deltas, choice=0) -> str:
    return "".join(d.text for d in deltas if d.index == choice)


def finish(deltas, choice=0) -> str | None:
    return next((d.finish_reason for d in deltas if d.index == choice and d.finish_reason), None)


def constrained(prompt, request_id, max_tokens=48, **sampling) -> GenerationRequest:
    params = SamplingParams(max_tokens=max_tokens, **{"temperature": 0, **sampling})
    return GenerationRequest(prompt, params, request_id=request_id, grammar=JSON)


def valid(deltas, choice=0) -> dict:
    assert finish(deltas, choice) == "stop", (finish(deltas, choice), text(deltas, choice))
    value = json.loads(text(deltas, choice))
    jsonschema.validate(value, SCHEMA)
    return value


@pytest.fixture(scope="module")
def engines(make_engine):
    return {"cached": make_engine(), "uncached": make_engine(enable_prefix_caching=False)}


def test_output_matches_the_schema_and_free_rows_share_the_step(engines, tokenizer):
    engine = engines["cached"]
    prompt = chat(tokenizer, "Weather in Paris for three days, as JSON.")
    free = GenerationRequest(prompt, SamplingParams(max_tokens=12, temperature=0), request_id="free")
    out = run(engine, [constrained(prompt, "json"), free])
    valid(out["json"])
    assert not text(out["free"]).startswith("{")  # the free row was not constrained
    # the free row's output equals a run without any constrained neighbour
    alone = run(engine, [GenerationRequest(prompt, SamplingParams(max_tokens=12, temperature=0),
                                           request_id="free-alone")])
    assert tokens(out["free"]) == tokens(alone["free-alone"])


def test_greedy_output_is_identical_cached_uncached_alone_and_batched(engines, tokenizer):
    prompts = [chat(tokenizer, task) for task in TASKS[:8]]
    target = chat(tokenizer, "Give the forecast for Oslo as JSON.")
    results = []
    for name in ("cached", "uncached"):
        engine = engines[name]
        alone = run(engine, [constrained(target, f"{name}-alone")])[f"{name}-alone"]
        warm = run(engine, [constrained(target, f"{name}-warm")])[f"{name}-warm"]  # cache hit
        busy = [GenerationRequest(p, SamplingParams(max_tokens=16, temperature=0),
                                  request_id=f"{name}-busy{i}") for i, p in enumerate(prompts)]
        batched = run(engine, [*busy, constrained(target, f"{name}-batched")])[f"{name}-batched"]
        for deltas in (alone, warm, batched):
            valid(deltas)
            results.append(tokens(deltas))
    assert all(r == results[0] for r in results), results
    engines["cached"].scheduler.cache.check_integrity()


def test_each_of_n_sampled_choices_matches_the_schema(engines, tokenizer):
    prompt = chat(tokenizer, "Weather in Rome as JSON.")
    request = constrained(prompt, "n4", temperature=1.0, seed=7, n=4)
    out = run(engines["cached"], [request])["n4"]
    values = [valid(out, choice) for choice in range(4)]
    assert len(values) == 4


@pytest.mark.parametrize("speculative_tokens", [0, 4])
def test_preemption_by_recompute_keeps_the_grammar_state(make_engine, tokenizer, speculative_tokens):
    # a pool too small for all rows at once: rows are preempted and recomputed mid-output
    # (with drafts of the grammar's forced tokens in flight, too)
    prompts = [chat(tokenizer, f"{task} Answer as JSON.") for task in TASKS[:6]]
    pages_per_seq = -(-(max(map(len, prompts)) + 128) // 16)
    tight = make_engine(num_pages=pages_per_seq * 2, watermark=0.0,
                        num_speculative_tokens=speculative_tokens)
    roomy = make_engine(num_speculative_tokens=0)
    spec = GrammarSpec("json_schema", json.dumps(LONG_SCHEMA))

    def requests():
        return [GenerationRequest(p, SamplingParams(max_tokens=128, temperature=0),
                                  request_id=f"r{i}", grammar=spec) for i, p in enumerate(prompts)]

    squeezed = run(tight, requests())
    assert tight.scheduler.num_preemptions > 0
    if speculative_tokens:
        assert tight.scheduler.drafter.num_accepted > 0
    reference = run(roomy, requests())
    for rid in squeezed:
        assert finish(squeezed[rid]) == "stop"
        jsonschema.validate(json.loads(text(squeezed[rid])), LONG_SCHEMA)
        assert tokens(squeezed[rid]) == tokens(reference[rid])


def test_max_tokens_cutting_the_json_finishes_with_length(engines, tokenizer):
    out = run(engines["cached"], [constrained(chat(tokenizer, "JSON please."), "cut", max_tokens=5)])
    assert finish(out["cut"]) == "length"
    assert len(tokens(out["cut"])) == 5
    with pytest.raises(json.JSONDecodeError):
        json.loads(text(out["cut"]))


def test_compile_once_per_spec_and_bad_grammars_are_request_errors(engines):
    engine = engines["cached"]
    stats = engine.grammars.compiler.stats
    spec = GrammarSpec("json_schema", json.dumps({"type": "object", "properties": {
        "x": {"type": "integer"}}}))
    first = engine.grammars.compile(spec)
    misses, hits = stats.misses, stats.hits
    assert engine.grammars.compile(GrammarSpec(spec.kind, spec.source, param="other")) is first
    assert (stats.misses, stats.hits) == (misses, hits + 1)
    engine.grammars.compile(GrammarSpec(spec.kind, spec.source, strict=False))  # a different grammar
    assert stats.misses == misses + 1
    for bad, param in [
        (GrammarSpec("json_schema", '{"type": "object", "properties": {"a": {"type": "strin"}}}',
                     param="response_format.json_schema.schema"), "response_format.json_schema.schema"),
        (GrammarSpec("regex", "(", param="response_format.regex"), "response_format.regex"),
        (GrammarSpec("ebnf", "root ::= ", param="response_format.grammar"), "response_format.grammar"),
        (GrammarSpec("choice", "[]", param="response_format.choice"), "response_format.choice"),
    ]:
        with pytest.raises(InvalidRequestError) as caught:
            engine.grammars.compile(bad)
        assert caught.value.param == param and caught.value.code == "invalid_grammar"


def test_a_dead_end_grammar_fails_its_request_alone(engines, tokenizer):
    engine = engines["cached"]
    prompt = chat(tokenizer, "Say anything.")
    # "a", then a character from an empty class: after one token nothing is allowed
    dead = GenerationRequest(prompt, SamplingParams(max_tokens=8, temperature=0),
                             request_id="dead",
                             grammar=GrammarSpec("ebnf", 'root ::= "a" [^\\x00-\\U0010FFFF]'))
    others = [constrained(prompt, "json-neighbour"),
              GenerationRequest(prompt, SamplingParams(max_tokens=8, temperature=0),
                                request_id="free-neighbour")]
    errors: list = []
    out = {r.request_id: [] for r in others}
    engine.add_request(dead, errors.append)
    for r in others:
        engine.add_request(r, out[r.request_id].append)
    while engine.has_work():
        engine.step()
    engine.scheduler.cache.check_integrity()
    # it streamed its one allowed token ("a"), then ended with the dead-end error
    assert [d.text for d in errors[:-1]] == ["a"], errors
    assert getattr(errors[-1], "code", None) == "grammar_dead_end", errors
    assert not engine.num_requests and not engine.has_work()
    stats = engine.scheduler.cache.stats()
    assert stats.pages_used == 0 and stats.pages_free + stats.pages_cached_free == engine.scheduler.cache.num_pages
    reference = run(engine, [constrained(prompt, "json-alone"),
                             GenerationRequest(prompt, SamplingParams(max_tokens=8, temperature=0),
                                               request_id="free-alone")])
    assert tokens(out["json-neighbour"]) == tokens(reference["json-alone"])
    assert tokens(out["free-neighbour"]) == tokens(reference["free-alone"])
    valid(out["json-neighbour"])


def test_logprobs_stay_those_of_the_raw_distribution(engines, tokenizer):
    prompt = chat(tokenizer, f"{SYSTEM} Reply in JSON.")
    out = run(engines["cached"], [constrained(prompt, "lp", logprobs=True, top_logprobs=3)])["lp"]
    valid(out)
    for delta in out:
        for lp in delta.logprobs or ():
            assert lp.logprob <= 0 and len(lp.top) == 3
            assert all(t.logprob > float("-inf") for t in lp.top)


def test_each_tenant_compiles_into_its_own_cache(engines):
    """A warm compile is microseconds, a cold one milliseconds: a cache shared across tenants
    would let one tenant time which schemas another sends. Tenants never share an entry."""
    engine = engines["cached"]
    spec = GrammarSpec("json_schema", json.dumps({"type": "object", "properties": {
        "tenant_probe": {"type": "boolean"}}}))
    alpha = engine.grammars.compile(spec, "alpha")
    misses = engine.grammars.compiler.stats.misses
    assert engine.grammars.compile(spec, "alpha") is alpha  # alpha's own entry: a hit
    assert engine.grammars.compiler.stats.misses == misses
    beta = engine.grammars.compile(spec, "beta")  # beta compiles its own: a miss, not alpha's
    assert engine.grammars.compiler.stats.misses == misses + 1 and beta is not alpha
