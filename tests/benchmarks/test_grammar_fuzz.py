"""benchmarks.grammar_fuzz, bounded: hypothesis schemas through the bounds, the compile worker
and the drafting probe with no violation; and the oracle catches one when the rule it checks
is broken (a regex schema let through to jump-forward)."""

from __future__ import annotations

import pytest

from benchmarks import grammar_fuzz as bench
from prefixgate.engine.grammar import GrammarCompiler
from prefixgate.engine.grammar.worker_pool import CompileLimits


@pytest.fixture(scope="module")
def compiler(tokenizer):
    compiler = GrammarCompiler(tokenizer, tokenizer.vocab_size, tokenizer.eos_token_ids,
                               limits=CompileLimits(timeout_s=20.0, memory_bytes=512 << 20,
                                                    max_workers=1))
    yield compiler
    compiler.close()


def test_a_bounded_fuzz_finds_no_violation(compiler):
    cases = bench.fuzz(compiler, examples=30)
    figures = bench.summary(cases)
    assert figures["cases"] == 30 and not figures["violations"], figures["violations"]
    outcomes = figures["outcomes"]
    # the generator reaches both sides: schemas that compile and are probed, and refusals
    assert outcomes.get("compiled", 0) >= 5 and figures["probed"] >= 5, outcomes
    assert set(outcomes) - {"compiled"}, outcomes
    assert all(c.seconds > 0 and c.peak_rss_mb > 0 for c in cases if c.outcome == "compiled")


def test_the_probe_reports_a_grammar_that_forces_text_without_end(compiler, monkeypatch):
    # pretend regexes were safe: the probe must then catch the pattern that forces "aaa..."
    monkeypatch.setattr(bench, "has_regex", lambda schema: False)
    case = bench.run_case(compiler, {"type": "string", "pattern": r"a*[^\s\S]"})
    assert case.outcome == "compiled" and case.violation is not None
    assert "grammar_too_complex" in case.violation
    fine = bench.run_case(compiler, {"type": "object", "properties": {"a": {"type": "integer"}},
                                     "required": ["a"]})
    assert fine.violation is None and fine.forced_chars >= len('{"a": ')
