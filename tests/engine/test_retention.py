"""Retention on the real engine: a session paused on a tool keeps its prefix through other
agents' traffic, where the plain LRU recomputes it; greedy output is the same either way."""

from __future__ import annotations

from prefixgate.engine.api import GenerationRequest
from tests.engine.test_engine import SYSTEM, TASKS, chat, greedy, run, tokens


def _session_returns(make_engine, tokenizer, retain: bool) -> tuple[int, list[int], object]:
    engine = make_engine(num_pages=24, watermark=0.0)
    paused = chat(tokenizer, SYSTEM + " " + SYSTEM + " Plan the release checklist.")
    first = run(engine, [GenerationRequest(paused, greedy(4), request_id="turn1")])["turn1"]
    if retain:
        assert engine.scheduler.cache.retain(paused, engine.extra_keys_for("default", None), 60.0) > 0
    # other agents' traffic meanwhile: distinct prompts needing more pages than are free
    others = [chat(tokenizer, f"{i}: {TASKS[i]} " * 14) for i in range(3)]
    run(engine, [GenerationRequest(p, greedy(2), request_id=f"o{i}") for i, p in enumerate(others)])
    back = run(engine, [GenerationRequest(paused, greedy(8), request_id="turn2")])["turn2"]
    assert tokens(first) == tokens(back)[:4]
    engine.scheduler.cache.check_integrity()
    return back[-1].usage.cached_tokens, tokens(back), engine.scheduler.cache.stats()


def test_a_retained_session_survives_other_traffic(make_engine, tokenizer):
    plain_hit, plain_out, plain_stats = _session_returns(make_engine, tokenizer, retain=False)
    kept_hit, kept_out, kept_stats = _session_returns(make_engine, tokenizer, retain=True)
    prompt = len(chat(tokenizer, SYSTEM + " " + SYSTEM + " Plan the release checklist."))
    assert kept_hit >= (prompt - 1) // 16 * 16  # all its full blocks came back from the cache
    assert plain_hit <= kept_hit - 3 * 16  # the LRU gave some of them to the other agents
    assert kept_out == plain_out  # retention changes which pages survive, never the output
    assert kept_stats.pages_retained > 0 and plain_stats.pages_retained == 0
    # the returning turn is a retention hit: its full blocks came from retained free pages
    # (the other agents' hits on the shared chat-template head were retention hits too)
    assert kept_stats.total.retention_hits >= 1 and plain_stats.total.retention_hits == 0
    assert kept_stats.total.retention_hit_tokens >= (prompt - 1) // 16 * 16
    assert kept_stats.retained_per_tenant == {"default": kept_stats.pages_retained}
