"""Speculative decoding on the real engine: greedy output is token-identical to plain decoding,
sampled output is whole and (seeded) reproducible whatever the drafts, drafts are accepted where
the context repeats, and rejected drafts leave no trace in the cache (every registered page
holds the K/V its tokens give). The sampling logic itself: tests/engine/test_sampler.py."""

from __future__ import annotations

import json

import torch

from prefixgate.engine import step_sampling
from prefixgate.engine.api import (
    EngineError,
    GenerationRequest,
    GrammarSpec,
    SamplingParams,
)
from tests.engine.test_constrained import JSON, LONG_SCHEMA, finish, valid
from tests.engine.test_engine import TASKS, chat, greedy, run, tokens

REPEAT = ("Copy this list exactly, twice: alpha, beta, gamma, delta, epsilon, zeta, eta, theta. "
          "Then copy it again.")
TOOL = ('Previous call: {"name": "search_code", "arguments": {"query": "retry policy", '
        '"path": "src/http"}}. Call search_code again with the same arguments.')
LONG_JSON = GrammarSpec("json_schema", json.dumps(LONG_SCHEMA))
ECHO = '{"tool": "search_code", "arguments": {"query": "retry policy", "path": "src/http", "limit": 5}}'


def _requests(tokenizer):
    prompts = [chat(tokenizer, REPEAT), chat(tokenizer, TOOL), *(chat(tokenizer, t) for t in TASKS[:3])]
    return [GenerationRequest(p, greedy(40), request_id=f"r{i}") for i, p in enumerate(prompts)]


def test_speculative_greedy_is_token_identical_and_leaves_exact_pages(make_engine, tokenizer):
    plain = make_engine(num_pages=128, num_speculative_tokens=0)
    want = {k: tokens(v) for k, v in run(plain, _requests(tokenizer)).items()}
    spec = make_engine(num_pages=128, num_speculative_tokens=4)
    got = run(spec, _requests(tokenizer))
    assert {k: tokens(v) for k, v in got.items()} == want
    drafter = spec.scheduler.drafter
    print(f"drafts {drafter.num_drafts}, proposed {drafter.num_proposed}, accepted {drafter.num_accepted}")
    assert drafter.num_accepted > 0 and spec.spec_tokens_accepted == drafter.num_accepted
    assert drafter.num_proposed > drafter.num_accepted  # some were rejected, too
    assert got["r0"][-1].usage.completion_tokens == 40
    spec.scheduler.cache.check_integrity()

    # rejected drafts left no trace: every page both engines registered holds the same K/V
    # (up to the summation order of a chunk vs a decode step)
    compared = 0
    for block_hash, page in spec.scheduler.cache.pool.cached.items():
        other = plain.scheduler.cache.pool.cached.get(block_hash)
        if other is None:
            continue
        a = spec.runner.kv_pool[:, :, page.page_id]
        b = plain.runner.kv_pool[:, :, other.page_id]
        assert torch.allclose(a, b, atol=1e-3, rtol=1e-3), block_hash.hex()
        compared += 1
    # the same blocks, generated ones included: no draft block was ever registered
    assert set(spec.scheduler.cache.pool.cached) == set(plain.scheduler.cache.pool.cached) and compared >= 15


def test_opted_out_requests_never_draft(make_engine, tokenizer):
    spec = make_engine(num_pages=64, num_speculative_tokens=4)
    opted_out = GenerationRequest(chat(tokenizer, REPEAT), greedy(12), request_id="o", speculative=False)
    run(spec, [opted_out])
    assert spec.scheduler.drafter.num_drafts == 0


def _constrained(tokenizer, tag: str, **sampling) -> list[GenerationRequest]:
    prompts = ["Weather in Oslo for 3 days, JSON.", "Give the forecast for Lima, two days, in fahrenheit.",
               TOOL]
    params = SamplingParams(**{"max_tokens": 48, "temperature": 0, **sampling})
    out = [GenerationRequest(chat(tokenizer, p), params, request_id=f"{tag}{i}", grammar=JSON)
           for i, p in enumerate(prompts)]
    out.append(GenerationRequest(chat(tokenizer, "List twenty-four digits."), params,
                                 request_id=f"{tag}long", grammar=LONG_JSON))
    return out


def test_constrained_rows_draft_what_the_grammar_forces_with_identical_output(make_engine, tokenizer):
    """A JSON row's keys and punctuation are forced by its grammar: they are drafted and
    accepted, and the output is token-identical to decoding one token a step (each verify row
    masked by the grammar's state after the drafts before it), valid, next to a free row."""
    def requests(tag):
        return [*_constrained(tokenizer, tag), GenerationRequest(chat(tokenizer, REPEAT), greedy(24),
                                                                 request_id=f"{tag}free")]
    plain = run(make_engine(num_pages=128, num_speculative_tokens=0), requests("p"))
    spec = make_engine(num_pages=128, num_speculative_tokens=4)
    got = run(spec, requests("s"))
    for rid, deltas in plain.items():
        assert tokens(got["s" + rid[1:]]) == tokens(deltas), rid
    for i in range(3):
        valid(got[f"s{i}"])
    drafter = spec.scheduler.drafter
    print(spec.spec_stats())
    assert drafter.num_accepted > 0 and spec.spec_tokens_accepted == drafter.num_accepted
    spec.scheduler.cache.check_integrity()
    assert spec.scheduler.cache.stats().pages_used == 0


def test_seeded_constrained_speculation_reproduces_plain_decoding(make_engine, tokenizer):
    """Sampled constrained rows (alone: no free row drafts here): rejection sampling over the
    masked distribution; seeded, the output is the one a plain decode gives, and valid."""
    plain = run(make_engine(num_pages=128, num_speculative_tokens=0),
                _constrained(tokenizer, "p", temperature=0.9, seed=11))
    spec_engine = make_engine(num_pages=128, num_speculative_tokens=4)
    spec = run(spec_engine, _constrained(tokenizer, "s", temperature=0.9, seed=11))
    assert spec_engine.scheduler.drafter.num_accepted > 0
    for rid, deltas in plain.items():
        assert tokens(spec["s" + rid[1:]]) == tokens(deltas), rid
    for i in range(3):
        if finish(spec[f"s{i}"]) == "stop":
            valid(spec[f"s{i}"])


def _echo(tokenizer) -> tuple[int, ...]:
    return tuple(tokenizer.apply_chat_template(
        [{"role": "user", "content": f"Repeat this JSON object exactly, three times, one per line:\n{ECHO}"}]))


def _sampled(tokenizer, tag: str, seed: int | None, **sampling) -> GenerationRequest:
    params = SamplingParams(**{"max_tokens": 48, "temperature": 0.8, "seed": seed, **sampling})
    return GenerationRequest(_echo(tokenizer), params, request_id=tag)


def test_sampled_requests_draft_accept_and_release_every_page(make_engine, tokenizer):
    """Temperature 0.8 (plain, top-p, top-k, unseeded): drafts are proposed and accepted, every
    output is whole (48 tokens, or fewer ending in a stop token) and decodes to its text, and
    the pool ends with every page free again."""
    spec = make_engine(num_pages=64, num_speculative_tokens=4)
    free_at_start = spec.scheduler.cache.num_free_pages
    requests = [_sampled(tokenizer, "s1", 1), _sampled(tokenizer, "s2", 2, top_p=0.95),
                _sampled(tokenizer, "s3", 3, top_k=40), _sampled(tokenizer, "u", None)]
    out = run(spec, requests)
    drafter = spec.scheduler.drafter
    print(spec.spec_stats())
    assert drafter.num_drafts > 0 and drafter.num_accepted > 0 and spec.spec_tokens_accepted > 0
    assert drafter.num_proposed > drafter.num_accepted
    for rid, deltas in out.items():
        got, last = tokens(deltas), deltas[-1]
        assert last.usage.completion_tokens == len(got), rid
        if last.finish_reason == "length":
            assert len(got) == 48, rid
        else:
            assert last.finish_reason == "stop" and len(got) < 48 and got[-1] in spec.output.eos_token_ids, rid
            got = got[:-1]  # the stop token is not shown
        assert "".join(d.text for d in deltas) == tokenizer.decode(got), rid
    spec.scheduler.cache.check_integrity()
    assert spec.scheduler.cache.stats().pages_used == 0 and spec.scheduler.cache.num_free_pages == free_at_start


def test_seeded_sampled_speculation_reproduces_whatever_the_drafts(make_engine, tokenizer):
    """A seeded sampled request gives the same output twice, with speculation off, and in a batch
    that changes how much it drafts (each emitted token takes the draw a plain decode would)."""
    spec = make_engine(num_pages=128, num_speculative_tokens=4)
    first = tokens(run(spec, [_sampled(tokenizer, "a", 7)])["a"])
    assert spec.scheduler.drafter.num_accepted > 0
    assert tokens(run(spec, [_sampled(tokenizer, "b", 7)])["b"]) == first
    plain = make_engine(num_pages=128, num_speculative_tokens=0)
    assert tokens(run(plain, [_sampled(tokenizer, "c", 7)])["c"]) == first
    # seven greedy neighbours fill the row cap: the seeded request drafts far less, or not at all
    busy = [GenerationRequest(chat(tokenizer, t), greedy(40), request_id=f"n{i}") for i, t in enumerate(TASKS[:7])]
    crowded = make_engine(num_pages=128, num_speculative_tokens=4)
    assert tokens(run(crowded, [*busy, _sampled(tokenizer, "d", 7)])["d"]) == first
    assert tokens(run(spec, [_sampled(tokenizer, "e", 8)])["e"]) != first  # the seed matters


def test_speculation_with_penalties_and_logprobs_is_token_identical(make_engine, tokenizer):
    """Penalties see the drafts before each verified position; logprobs are each emitted
    position's, as in a plain decode."""
    params = [greedy(40, repetition_penalty=1.1, logprobs=True, top_logprobs=2),
              greedy(40, presence_penalty=0.3, frequency_penalty=0.2),
              SamplingParams(max_tokens=40, temperature=0.8, seed=3, frequency_penalty=0.3, logprobs=True)]
    requests = lambda: [GenerationRequest(_echo(tokenizer), p, request_id=f"p{i}")  # noqa: E731
                        for i, p in enumerate(params)]
    plain = run(make_engine(num_pages=128, num_speculative_tokens=0), requests())
    spec_engine = make_engine(num_pages=128, num_speculative_tokens=4)
    spec = run(spec_engine, requests())
    assert spec_engine.scheduler.drafter.num_accepted > 0
    for rid in plain:
        assert tokens(spec[rid]) == tokens(plain[rid]), rid
        lps = lambda deltas: [lp for d in deltas for lp in (d.logprobs or ())]  # noqa: E731
        for a, b in zip(lps(spec[rid]), lps(plain[rid]), strict=True):
            assert a.token_id == b.token_id and abs(a.logprob - b.logprob) < 1e-3
            assert [t.token_id for t in a.top] == [t.token_id for t in b.top]
    assert len(lps(spec["p0"])) == 40 and all(len(lp.top) == 2 for lp in lps(spec["p0"]))


def test_speculation_under_page_pressure_keeps_outputs(make_engine, tokenizer):
    """A pool too small for every sequence: drafts never take a page a decode needs, and
    preemption (recompute) with drafts in flight changes no output."""
    requests = lambda tag: [GenerationRequest(r.prompt_token_ids, r.sampling, request_id=f"{tag}{i}")  # noqa: E731
                            for i, r in enumerate(_requests(tokenizer))]
    plain = run(make_engine(num_pages=128, num_speculative_tokens=0), requests("p"))
    pages = -(-(max(len(r.prompt_token_ids) for r in requests("x")) + 40) // 16)
    tight = make_engine(num_pages=pages * 2, watermark=0.0, num_speculative_tokens=4)
    got = run(tight, requests("t"))
    assert [tokens(got[f"t{i}"]) for i in range(5)] == [tokens(plain[f"p{i}"]) for i in range(5)]
    assert tight.scheduler.drafter.num_accepted > 0 and tight.scheduler.num_preemptions > 0
    tight.scheduler.cache.check_integrity()
    assert tight.scheduler.cache.stats().pages_used == 0


def test_no_draft_past_the_step_row_cap(make_engine, tokenizer):
    capped = make_engine(num_pages=64, num_speculative_tokens=4, speculative_max_rows=1)
    run(capped, [GenerationRequest(chat(tokenizer, REPEAT), greedy(16), request_id="c")])
    assert capped.scheduler.drafter.num_drafts == 0  # one decode row already fills the cap


def test_a_verification_fault_fails_its_request_alone(make_engine, tokenizer, monkeypatch):
    """The batched verification raises (after drawing): only the poison's request fails, and
    the seeded neighbours' outputs are those of a clean run (their generators are rewound
    before the one-by-one retry)."""
    clean_engine = make_engine(num_pages=128, num_speculative_tokens=4)
    clean = run(clean_engine, [_sampled(tokenizer, "a", 7), _sampled(tokenizer, "b", 8, top_p=0.9)])
    real = step_sampling.verify
    calls = {"raised": 0}

    def verify(logits, rows, drafts, token_bitmask=None):
        result = real(logits, rows, drafts, token_bitmask)
        if any(r.params.seed == 666 for r in rows):
            calls["raised"] += 1
            raise RuntimeError("injected verification fault")
        return result

    monkeypatch.setattr(step_sampling, "verify", verify)
    engine = make_engine(num_pages=128, num_speculative_tokens=4)
    out = run(engine, [_sampled(tokenizer, "a", 7), _sampled(tokenizer, "b", 8, top_p=0.9),
                       _sampled(tokenizer, "p", 666)])
    assert calls["raised"] >= 2  # batched, then alone
    assert isinstance(out["p"][-1], EngineError) and out["p"][-1].code == "request_failed"
    assert tokens(out["a"]) == tokens(clean["a"]) and tokens(out["b"]) == tokens(clean["b"])
    assert engine.scheduler.cache.stats().pages_used == 0 and engine.num_requests == 0
