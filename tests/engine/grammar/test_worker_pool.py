"""engine/grammar/worker_pool.py (+ worker.py, frames.py) with the default tokenizer:
a compile past its time or memory limit is a 400 naming the limit, the worker is replaced and
the next compile works; the result is the same grammar an in-process compile gives; concurrent
compiles share the workers; the compiled-grammar cache is bounded in bytes per tenant."""

from __future__ import annotations

import json
import threading

import pytest

from prefixgate.engine.api import GrammarSpec, InvalidRequestError, OverloadedError
from prefixgate.engine.grammar import GrammarCompiler, new_matcher
from prefixgate.engine.grammar.worker_pool import CompileLimits

CITY = GrammarSpec("json_schema", json.dumps({
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}))
# 500 nested starred groups (4.5 kB): over 30 s of compile on a 2-core Xeon, far past the 4 s
# limit below (which leaves the small compiles a wide margin on a loaded machine)
SLOW = GrammarSpec("ebnf", "root ::= " + "(" * 500 + '"a"' + ' | "b")*' * 500, param="grammar")
# ~100 MB of xgrammar state while compiling
HUNGRY = GrammarSpec("regex", "([a-z]{1,300}){1,300}", param="regex")


def make(tokenizer, **limits) -> GrammarCompiler:
    return GrammarCompiler(tokenizer, tokenizer.vocab_size, tokenizer.eos_token_ids,
                           limits=CompileLimits(**limits))


def accepts(compiled, text: str) -> bool:
    matcher = new_matcher(compiled)
    return matcher.accept_string(text) and matcher.is_completed()


@pytest.fixture(scope="module")
def compiler(tokenizer):
    compiler = make(tokenizer, timeout_s=60.0)
    yield compiler
    compiler.close()


def test_a_worker_compile_is_the_grammar_an_in_process_compile_gives(compiler, tokenizer):
    local = make(tokenizer, max_workers=0)
    remote = compiler.compile(CITY)
    assert compiler.pool is not None and compiler.pool.num_workers >= 1
    for text, ok in [('{"city": "Paris"}', True), ('{"city": 3}', False), ("{}", False)]:
        assert accepts(remote, text) is ok is accepts(local.compile(CITY), text)


def test_a_compile_past_its_time_limit_is_a_400_and_the_worker_is_replaced(tokenizer):
    compiler = make(tokenizer, timeout_s=4.0, max_workers=1)
    try:
        compiler.compile(CITY)  # the worker is up (its start is not the compile's time)
        first = compiler.pool._idle[0].process
        with pytest.raises(InvalidRequestError) as info:
            compiler.compile(SLOW)
        assert info.value.code == "grammar_too_complex" and info.value.param == "grammar"
        assert "4 s" in info.value.message and "--grammar-compile-timeout" in info.value.message
        assert compiler.stats.limit_failures == 1 and compiler.pool.num_timeouts == 1
        assert first.poll() is not None  # killed, not left compiling
        # a fresh worker (started as the old one went) serves the next compile
        other = GrammarSpec("json_schema", json.dumps({"type": "array", "items": {"type": "integer"}}))
        assert accepts(compiler.compile(other), "[1, 2]")
        assert compiler.pool._idle[0].process.pid != first.pid
        assert compiler.pool.num_workers == 1 and compiler.pool.num_restarts == 1
    finally:
        compiler.close()


def test_a_compile_past_its_memory_limit_is_a_400_naming_it(tokenizer):
    compiler = make(tokenizer, memory_bytes=32 << 20, timeout_s=120.0, max_workers=1)
    try:
        with pytest.raises(InvalidRequestError) as info:
            compiler.compile(HUNGRY)
        assert info.value.code == "grammar_too_complex" and info.value.param == "regex"
        assert "32 MiB" in info.value.message and "--grammar-compile-memory" in info.value.message
        assert compiler.pool.num_memory_failures == 1
        assert accepts(compiler.compile(CITY), '{"city": "Oslo"}')
    finally:
        compiler.close()


def test_an_invalid_grammar_keeps_xgrammars_words_without_its_source_path(compiler):
    with pytest.raises(InvalidRequestError) as info:
        compiler.compile(GrammarSpec("regex", "(", param="response_format.regex"))
    assert info.value.code == "invalid_grammar" and info.value.param == "response_format.regex"
    assert "parenthesis" in info.value.message and ".cc:" not in info.value.message


def test_a_json_schema_no_value_satisfies_never_reaches_a_worker(compiler):
    before = compiler.stats.misses
    spec = GrammarSpec("json_schema", json.dumps(
        {"type": "object", "properties": {"a": {"$ref": "#"}}, "required": ["a"]}))
    with pytest.raises(InvalidRequestError) as info:
        compiler.compile(spec)
    assert info.value.code == "schema_unsatisfiable" and compiler.stats.misses == before


def test_callers_past_the_worker_count_wait_for_one_then_get_a_429(tokenizer):
    compiler = make(tokenizer, timeout_s=2.0, queue_timeout_s=0.2, max_workers=1)
    try:
        compiler.compile(CITY)
        results: list[BaseException | None] = []

        def slow() -> None:
            try:
                compiler.compile(SLOW)
            except InvalidRequestError as exc:
                results.append(exc)

        thread = threading.Thread(target=slow)
        thread.start()
        while not compiler.pool._num_workers or compiler.pool._idle:
            pass  # the slow compile holds the only worker
        with pytest.raises(OverloadedError):
            compiler.compile(GrammarSpec("json_schema", '{"type": "integer"}'))
        thread.join()
        assert len(results) == 1
    finally:
        compiler.close()


def test_a_flood_of_distinct_schemas_stays_within_the_cache_budget(tokenizer):
    compiler = make(tokenizer, max_workers=0)
    compiler.cache = type(compiler.cache)(400_000)  # 200 kB a tenant
    beta = compiler.compile(CITY, "beta")
    for i in range(40):  # alpha floods
        compiler.compile(GrammarSpec("json_schema", json.dumps(
            {"type": "object", "properties": {f"field_{i}": {"type": "string"}},
             "required": [f"field_{i}"]})), "alpha")
        assert compiler.cache.num_bytes <= 400_000
        assert compiler.cache.scope_num_bytes("alpha") <= 200_000
    assert compiler.compile(CITY, "beta") is beta  # beta's entry survived alpha's flood
    assert compiler.stats.hits == 1


def test_the_probe_walks_a_grammar_as_drafting_would(compiler, tokenizer):
    assert compiler.pool is not None
    forced = compiler.pool.compile("json_schema", CITY.source, True, "p", probe_steps=8)
    assert forced.forced_chars is not None and forced.forced_chars >= len('{"city": "')
    # text forced without end grows until the worker's cap: a 400 there, this process unharmed
    small = make(tokenizer, memory_bytes=256 << 20, timeout_s=120.0, max_workers=1)
    try:
        with pytest.raises(InvalidRequestError) as info:
            small.pool.compile("ebnf", 'root ::= "a" root', True, "grammar", probe_steps=2)
        assert info.value.code == "grammar_too_complex"
    finally:
        small.close()
