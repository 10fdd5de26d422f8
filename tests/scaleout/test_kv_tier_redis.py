"""The fleet's KV tier in a real redis-server: a prefix one replica computed and evicted is
loaded by another replica instead of recomputed, with identical greedy output; Redis dying
mid-load means recompute, and serving goes on."""

from __future__ import annotations

import threading

from prefixgate.gateway.engine.api import GenerationRequest
from prefixgate.gateway.engine.config import EngineConfig
from prefixgate.gateway.engine.factory import create_llm_engine
from prefixgate.gateway.scaleout.kv_tier_redis import RedisTier
from tests.engine.test_engine import SYSTEM, TASKS, chat, greedy, run, tokens

PROMPT = SYSTEM + " " + SYSTEM + " Plan the release checklist."


def _replica(loaded_model, redis_url: str):
    store = RedisTier(redis_url, 64 << 20, namespace="kvtier-test")
    engine, _ = create_llm_engine(EngineConfig(num_pages=24, page_size=16, watermark=0.0, device="cpu"),
                                  loaded=loaded_model, tier_store=store)
    # NOTE: the 1 s load deadline is for serving; on a loaded 2-core CI box a load can take
    # longer and the (correct) fallback, recompute, would fail the hit assertions below
    engine.tier.load_timeout_s = 30.0
    return engine


def _ask(engine, tokenizer, request_id: str) -> tuple[list[int], int]:
    deltas = run(engine, [GenerationRequest(chat(tokenizer, PROMPT), greedy(6), request_id=request_id)])[request_id]
    engine.cache.check_integrity()
    return tokens(deltas), deltas[-1].usage.cached_tokens


def test_a_replica_loads_what_another_computed_and_survives_redis_dying(
        loaded_model, tokenizer, redis_server):
    full_blocks = (len(chat(tokenizer, PROMPT)) - 1) // 16 * 16
    others = [chat(tokenizer, f"{i}: {TASKS[i]} " * 14) for i in range(3)]
    first = _replica(loaded_model, redis_server.url)
    want, _ = _ask(first, tokenizer, "a1")
    run(first, [GenerationRequest(p, greedy(2), request_id=f"o{i}") for i, p in enumerate(others)])
    first.tier.flush()  # the other agents' traffic evicted the session's pages into Redis
    assert first.tier.stats().pages_spilled > 0

    def replica_with_the_system_prompt():
        # NOTE: the shared system-prompt blocks never left the first replica's pool (every
        # request hits them), so they are not in the tier: this replica computes them itself
        engine = _replica(loaded_model, redis_server.url)
        run(engine, [GenerationRequest(others[0], greedy(1), request_id="head")])
        return engine

    second = replica_with_the_system_prompt()
    out, cached = _ask(second, tokenizer, "b1")
    stats = second.tier.stats()
    assert out == want
    assert cached == full_blocks, stats  # the rest of the session came from Redis
    assert stats.hits == 1 and stats.pages_loaded > 0 and stats.errors == 0
    assert second.tier_tokens_loaded == stats.pages_loaded * 16
    # what its heartbeat tells the router a tier block is worth here: 1 - load / recompute
    # seconds per token, both measured (the "head" prefill timed the recompute)
    per_token = stats.load_seconds / (stats.pages_loaded * 16)
    assert second.seconds_per_token > 0
    assert second.tier_load_discount() == max(0.0, 1 - per_token / second.seconds_per_token)
    assert 0 <= second.tier_load_discount() <= 1

    # Redis dies mid-load: the probe found the blocks, the fetch fails -> recompute, output
    # unchanged, and the engine keeps serving (Redis is then skipped for a while, no stalls)
    third = replica_with_the_system_prompt()
    gate = threading.Event()
    third.tier._loader.submit(gate.wait)  # hold the load worker until Redis is gone
    deltas: list = []
    third.add_request(GenerationRequest(chat(tokenizer, PROMPT), greedy(6), request_id="c1"),
                      deltas.append)
    probes = third.tier.stats().probes
    third.step()
    assert third.tier.stats().probes == probes + 1  # the load is queued behind the gate
    redis_server.kill()
    try:
        gate.set()
        while third.has_work():
            third.step()
        assert tokens(deltas) == want and deltas[-1].usage.cached_tokens < full_blocks
        assert third.tier.stats().errors == 1 and third.tier.stats().pages_loaded == 0
        again, _ = _ask(third, tokenizer, "c2")
        assert again == want
        third.cache.check_integrity()
    finally:
        redis_server.start()
    for engine in (first, second, third):
        engine.tier.close()
