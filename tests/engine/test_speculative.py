"""Speculative decoding on the real engine: greedy output is token-identical to plain decoding,
drafts are accepted where the context repeats, and rejected drafts leave no trace in the cache
(every registered page holds the K/V its tokens give)."""

from __future__ import annotations

import torch

from prefixgate.gateway.engine.api import GenerationRequest, SamplingParams
from tests.engine.test_engine import TASKS, chat, greedy, run, tokens

REPEAT = ("Copy this list exactly, twice: alpha, beta, gamma, delta, epsilon, zeta, eta, theta. "
          "Then copy it again.")
TOOL = ('Previous call: {"name": "search_code", "arguments": {"query": "retry policy", '
        '"path": "src/http"}}. Call search_code again with the same arguments.')


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
    spec.cache.check_integrity()

    # rejected drafts left no trace: every page both engines registered holds the same K/V
    # (up to the summation order of a chunk vs a decode step)
    compared = 0
    for block_hash, page in spec.cache.pool.cached.items():
        other = plain.cache.pool.cached.get(block_hash)
        if other is None:
            continue
        a = spec.runner.kv_pool[:, :, page.page_id]
        b = plain.runner.kv_pool[:, :, other.page_id]
        assert torch.allclose(a, b, atol=1e-3, rtol=1e-3), block_hash.hex()
        compared += 1
    # the same blocks, generated ones included: no draft block was ever registered
    assert set(spec.cache.pool.cached) == set(plain.cache.pool.cached) and compared >= 15


def test_sampled_and_opted_out_requests_never_draft(make_engine, tokenizer):
    spec = make_engine(num_pages=64, num_speculative_tokens=4)
    prompt = chat(tokenizer, REPEAT)
    sampled = GenerationRequest(prompt, SamplingParams(max_tokens=12, temperature=0.7, seed=1), request_id="s")
    opted_out = GenerationRequest(prompt, greedy(12), request_id="o", speculative=False)
    run(spec, [sampled, opted_out])
    assert spec.scheduler.drafter.num_drafts == 0


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
    tight.cache.check_integrity()
    assert tight.cache.stats().pages_used == 0


def test_no_draft_past_the_step_row_cap(make_engine, tokenizer):
    capped = make_engine(num_pages=64, num_speculative_tokens=4, speculative_max_rows=1)
    run(capped, [GenerationRequest(chat(tokenizer, REPEAT), greedy(16), request_id="c")])
    assert capped.scheduler.drafter.num_drafts == 0  # one decode row already fills the cap
