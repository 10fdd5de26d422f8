"""The fleet's KV tier in a real redis-server: a prefix one replica computed and evicted is
loaded by another replica instead of recomputed, with identical greedy output; Redis dying
mid-load means recompute, and serving goes on. Entries are authenticated under the fleet
secret (forged, flipped, truncated, swapped and foreign values are never served), and entries
Redis drops behind a replica's back are written again."""

from __future__ import annotations

import threading

from prefixgate.cache.hashing import HashedBlock
from prefixgate.cache.tier import TierEntry, decode_entry
from prefixgate.engine.api import GenerationRequest
from prefixgate.engine.build import create_llm_engine
from prefixgate.engine.config import EngineConfig
from prefixgate.gateway.scaleout.kv_tier_redis import MAC_BYTES, RedisTier, entry_mac, mac_key
from tests.engine.test_engine import SYSTEM, TASKS, chat, greedy, run, tokens

PROMPT = SYSTEM + " " + SYSTEM + " Plan the release checklist."
SECRET = "fleet-secret-for-the-tests"


def _replica(loaded_model, redis_url: str, namespace: str = "kvtier-test", num_pages: int = 24,
             **tier_options):
    store = RedisTier(redis_url, 64 << 20, namespace=namespace, secret=SECRET, **tier_options)
    engine, _ = create_llm_engine(EngineConfig(num_pages=num_pages, page_size=16, watermark=0.0,
                                               device="cpu"),
                                  loaded=loaded_model, tier_store=store)
    # NOTE: the 1 s load deadline is for serving; on a loaded 2-core CI box a load can take
    # longer and the (correct) fallback, recompute, would fail the hit assertions below
    engine.tier.load_timeout_s = 30.0
    return engine


def _ask(engine, tokenizer, request_id: str) -> tuple[list[int], int]:
    deltas = run(engine, [GenerationRequest(chat(tokenizer, PROMPT), greedy(6), request_id=request_id)])[request_id]
    engine.scheduler.cache.check_integrity()
    return tokens(deltas), deltas[-1].usage.cached_tokens


def test_a_replica_loads_what_another_computed_and_survives_redis_dying(
        loaded_model, tokenizer, own_redis):
    full_blocks = (len(chat(tokenizer, PROMPT)) - 1) // 16 * 16
    others = [chat(tokenizer, f"{i}: {TASKS[i]} " * 14) for i in range(3)]
    first = _replica(loaded_model, own_redis.url)
    want, _ = _ask(first, tokenizer, "a1")
    run(first, [GenerationRequest(p, greedy(2), request_id=f"o{i}") for i, p in enumerate(others)])
    first.tier.flush()  # the other agents' traffic evicted the session's pages into Redis
    assert first.tier.stats().pages_spilled > 0

    def replica_with_the_system_prompt():
        # NOTE: the shared system-prompt blocks never left the first replica's pool (every
        # request hits them), so they are not in the tier: this replica computes them itself
        engine = _replica(loaded_model, own_redis.url)
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
    own_redis.kill()
    try:
        gate.set()
        while third.has_work():
            third.step()
        assert tokens(deltas) == want and deltas[-1].usage.cached_tokens < full_blocks
        assert third.tier.stats().errors == 1 and third.tier.stats().pages_loaded == 0
        again, _ = _ask(third, tokenizer, "c2")
        assert again == want
        third.scheduler.cache.check_integrity()
    finally:
        own_redis.start()
    for engine in (first, second, third):
        engine.tier.close()


def _evict_into_the_tier(engine, tokenizer, tag: str) -> None:
    """Serve PROMPT, then another agent's prompt that evicts its pages (spilled to Redis)."""
    _ask(engine, tokenizer, f"{tag}-ask")
    other = chat(tokenizer, f"0: {TASKS[0]} " * 16)
    run(engine, [GenerationRequest(other, greedy(1), request_id=f"{tag}-other")])
    engine.tier.flush()


def _prompt_keys(engine, tokenizer, namespace: str) -> set[bytes]:
    """The Redis keys PROMPT's blocks would have."""
    blocks = engine.scheduler.cache.hasher.hash_blocks(chat(tokenizer, PROMPT),
                                             engine.extra_keys_for("default", None))
    return {f"{namespace}:kv:".encode() + b.block_hash for b in blocks}


def _entry_keys(client, namespace: str) -> set[bytes]:
    return set(client.scan_iter(match=f"{namespace}:kv:*".encode(), count=1000))


def test_forged_entries_are_never_served(redis_server):
    """Someone who can write to Redis but lacks the fleet secret plants an entry with zeroed
    K/V and a recomputed (keyless) checksum, and one with a MAC under another secret: the store
    hands both on as corrupt (b"", never decoded), and the engine recomputes."""
    client = redis_server.client()
    store = RedisTier(redis_server.url, 8 << 20, namespace="kvtier-forged", secret=SECRET)
    block = HashedBlock(b"h" * 16, b"p" * 16, b"\x01\x00\x00\x00" * 16, b"tenant-salt")
    honest = TierEntry(block, b"layout", bytes(range(256)) * 4).encode()
    assert store.put(block.block_hash, honest)
    assert decode_entry(store.get_many([block.block_hash])[0]) is not None
    forged = TierEntry(block, b"layout", bytes(1024)).encode()
    assert decode_entry(forged) is not None  # the keyless checksum alone would accept it
    key = store._key(block.block_hash)
    for value in (forged, bytes(MAC_BYTES) + forged,
                  entry_mac(mac_key("not-the-fleet-secret"), key, forged) + forged):
        client.set(key, value)
        assert store.get_many([block.block_hash]) == [b""]
        assert decode_entry(b"") is None  # KVTier counts it corrupt and discards it


def test_flipped_truncated_swapped_and_foreign_values_fail_authentication(redis_server):
    client = redis_server.client()
    store = RedisTier(redis_server.url, 8 << 20, namespace="kvtier-mac", secret=SECRET)
    foreign = RedisTier(redis_server.url, 8 << 20, namespace="kvtier-mac", secret=SECRET + "x")
    a, b, c, d, e = (bytes([i]) * 16 for i in range(1, 6))
    for key in (a, b, c, d):
        assert store.put(key, b"entry of " + key)
    assert store.get_many([a]) == [b"entry of " + a]
    key_of = store._key
    flipped = bytearray(client.get(key_of(b)))
    flipped[-1] ^= 1
    client.set(key_of(b), bytes(flipped))
    client.set(key_of(c), client.get(key_of(c))[:-3])
    client.set(key_of(d), client.get(key_of(a)))  # a's value under d's key
    assert foreign.put(e, b"entry of " + e)
    assert store.get_many([a, b]) == [b"entry of " + a, b""]  # b"" = corrupt: never decoded
    assert store.get_many([c]) == [b""]
    assert store.get_many([d]) == [b""]
    assert store.get_many([e]) == [b""]
    assert foreign.get_many([a]) == [b""]


def test_entries_redis_drops_are_written_again(loaded_model, tokenizer, own_redis):
    """Deleted behind the replica's back (as the TTL or allkeys-lru would), then evicted from
    the pool again: the entries come back. Then real allkeys-lru evictions, and again."""
    client = own_redis.client()
    namespace = "kvtier-respill"
    # 20 pages: PROMPT (12 blocks) and the other prompt (17, the system prompt's shared) do not
    # fit together, so serving the other evicts PROMPT's own blocks
    engine = _replica(loaded_model, own_redis.url, namespace, num_pages=20, confirm_s=0.0)
    _evict_into_the_tier(engine, tokenizer, "r1")
    # (the shared system prompt's blocks stay in the pool: the other prompt hits them)
    written = _entry_keys(client, namespace) & _prompt_keys(engine, tokenizer, namespace)
    assert len(written) >= 3, written
    client.delete(*written)
    _evict_into_the_tier(engine, tokenizer, "r2")  # recomputed, then evicted again
    assert written <= _entry_keys(client, namespace)

    # Redis itself evicts (allkeys-lru under maxmemory) while junk fills it
    used = client.info("memory")["used_memory"]
    client.config_set("maxmemory-policy", "allkeys-lru")
    client.config_set("maxmemory", used + (4 << 20))
    for i in range(16):
        client.set(f"junk:{i}", bytes(1 << 20))
    assert not written <= _entry_keys(client, namespace)  # some of ours are gone
    client.delete(*[f"junk:{i}" for i in range(16)])
    client.config_set("maxmemory", 0)
    _evict_into_the_tier(engine, tokenizer, "r3")
    assert written <= _entry_keys(client, namespace)
    engine.tier.close()
