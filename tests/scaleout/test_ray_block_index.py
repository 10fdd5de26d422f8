"""The Ray Serve router's block index (gateway/scaleout/ray_serve/block_index.py), without a
model or Ray: it follows a real publisher's stream, joins late through the replay socket,
counts only leading blocks of the pool, forgets removed and cleared blocks, and gives Ray's
own prefix router a non-empty text for every request (forwarded.message_texts)."""

from __future__ import annotations

from prefixgate.cache.events import BlockRemoved, BlockStored
from prefixgate.cache.hashing import BlockHasher, HashedBlock, make_extra_keys
from prefixgate.gateway.scaleout.kv_events import wire
from prefixgate.gateway.scaleout.kv_events.config import parse_kv_events_config
from prefixgate.gateway.scaleout.kv_events.publisher import KVEventPublisher
from prefixgate.gateway.scaleout.ray_serve.block_index import BlockIndex
from prefixgate.gateway.scaleout.ray_serve.forwarded import message_texts
from tests.scaleout.conftest import wait_for

PS = 4
CONFIG = ('{"enable_kv_cache_events": true, "endpoint": "tcp://127.0.0.1:*", '
          '"replay_endpoint": "tcp://127.0.0.1:*"}')


def _chain(tokens: list[int]) -> list[HashedBlock]:
    return BlockHasher(PS, seed=7).hash_blocks(tokens, make_extra_keys("m", "default", None))


def _stored(block: HashedBlock) -> BlockStored:
    return BlockStored(block.block_hash, block.parent_hash, PS, block.token_bytes, block.extra_keys)


def _u64(chain: list[HashedBlock]) -> list[int]:
    return [wire.u64(b.block_hash) for b in chain]


def test_index_follows_a_publisher_joined_late():
    pub = KVEventPublisher(parse_kv_events_config(CONFIG), topic="kv@pod@m", block_size=PS)
    pub.start()
    index = BlockIndex(poll_ms=5)
    try:
        chain = _chain(list(range(1, 17)))  # 4 full blocks
        other = _chain(list(range(100, 109)))  # 2 full blocks, another prompt
        # the first batch is the resync (the pool's snapshot covers what was queued before it)
        wait_for(lambda: pub.status.batches >= 1, 10, "the first batch")
        for block in chain[:3]:  # published before the index watches: replay must bring them
            pub.pool_sink(_stored(block))
        wait_for(lambda: pub.status.stored >= 3, 10, "3 blocks published")
        index.watch("r1", pub.endpoint, pub.replay_endpoint)
        wait_for(lambda: index.matched_blocks("r1", _u64(chain)) == 3, 10, "the replayed blocks",
                 explain=lambda: str(index.replicas))
        pub.pool_sink(_stored(chain[3]))
        for block in other:
            pub.pool_sink(_stored(block))
        wait_for(lambda: index.matched_blocks("r1", _u64(chain)) == 4, 10, "a live block")
        assert index.matched_blocks("r1", _u64(other)) == 2
        assert index.matched_blocks("r2", _u64(chain)) == 0  # not watched: nothing held
        # a middle block removed: only the leading run counts
        pub.pool_sink(BlockRemoved(chain[1].block_hash))
        wait_for(lambda: index.matched_blocks("r1", _u64(chain)) == 1, 10, "a removal")
        # a tier's store is not the pool: it does not count as held
        stored, _ = pub.tier_sinks("CPU")
        stored(chain[1])
        pub.pool_sink(_stored(_chain(list(range(200, 205)))[0]))  # a later pool batch
        wait_for(lambda: index.replicas["r1"].batches >= 5, 10, "the later batches")
        assert index.matched_blocks("r1", _u64(chain)) == 1
        assert index.errors == 0 and index.replicas["r1"].gaps == 0
        index.forget("r1")
        assert index.matched_blocks("r1", _u64(chain)) == 0
    finally:
        index.close()
        pub.stop()


def test_message_texts_are_never_empty():
    body = b'{"system": "S", "messages": [{"role": "user", "content": "hi"}]}'
    assert message_texts("POST", "/v1/messages", body) == [
        {"content": "S"}, {"role": "user", "content": "hi"}]
    assert message_texts("POST", "/v1/completions", b'{"prompt": "p"}') == [{"content": "p"}]
    assert message_texts("POST", "/v1/responses", b'{"instructions": "I", "input": "x"}') == [
        {"content": "I"}, {"content": "x"}]
    for method, path, body in (("GET", "/v1/models", b""), ("POST", "/v1/messages", b"{bad"),
                               ("POST", "/tokenize", b'{"model": "m"}')):
        texts = message_texts(method, path, body)
        assert texts and texts[0]["content"], (method, path, texts)
