"""KV events in vLLM's format (gateway/scaleout/kv_events), without a model: the config, the
wire format through a decoder written from llm-d's rules, chains, salted blocks, tier media,
a full queue's resync and a late subscriber's replay."""

from __future__ import annotations

import time

import pytest

from prefixgate.cache.events import BlockRemoved, BlockStored
from prefixgate.cache.hashing import BlockHasher, HashedBlock, make_extra_keys
from prefixgate.gateway.scaleout.kv_events import wire
from prefixgate.gateway.scaleout.kv_events.config import KVEventsConfig, parse_kv_events_config
from prefixgate.gateway.scaleout.kv_events.publisher import KVEventPublisher
from tests.scaleout.conftest import wait_for
from tests.scaleout.kv_events_decoder import (
    Index,
    Rejected,
    Subscriber,
    decode_message,
    replay,
)

PS = 4
ON = '{"enable_kv_cache_events": true, "endpoint": "tcp://127.0.0.1:*", ' \
     '"replay_endpoint": "tcp://127.0.0.1:*"%s}'


def test_config_takes_vllms_json_and_rejects_typos():
    cfg = parse_kv_events_config('{"enable_kv_cache_events": true, "publisher": "zmq", '
                                 '"endpoint": "tcp://*:5557", "replay_endpoint": "tcp://*:5558", '
                                 '"topic": "kv@pod@m", "buffer_steps": 100, "hwm": 10, '
                                 '"max_queue_size": 1000}')
    assert cfg.enabled and cfg.replay_endpoint == "tcp://*:5558" and cfg.salted_blocks == "omit"
    assert parse_kv_events_config('{"enable_kv_cache_events": true}').publisher == "zmq"
    assert not parse_kv_events_config('{}').enabled  # off by default, as in vLLM
    assert not parse_kv_events_config('{"enable_kv_cache_events": true, "publisher": "null"}').enabled
    for bad in ('[]', '{"enable_kv_cache_event": true}', '{"publisher": "nats"}',
                '{"endpoint": "http://x"}', '{"hwm": "10"}', '{"salted_blocks": "hash"}', 'nope'):
        with pytest.raises(ValueError, match="kv-events-config"):
            parse_kv_events_config(bad)


def test_cli_flag_and_environment_variable():
    from prefixgate.gateway.cli import build_parser, configs, resolve

    parser = build_parser()
    args = parser.parse_args(["serve"])
    _, settings = configs(resolve(args, parser, {}))
    assert settings.kv_events is None
    env = {"PREFIXGATE_KV_EVENTS_CONFIG": '{"enable_kv_cache_events": true}'}
    _, settings = configs(resolve(args, parser, env))
    assert settings.kv_events == KVEventsConfig(enable_kv_cache_events=True, publisher="zmq")
    with pytest.raises(SystemExit):
        parser.parse_args(["serve", "--kv-events-config", '{"enable": true}'])


def _chain(tokens, tenant="default", cache_salt=None) -> list[HashedBlock]:
    return BlockHasher(PS, seed=7).hash_blocks(tokens, make_extra_keys("m", tenant, cache_salt))


def _stored(block: HashedBlock) -> BlockStored:
    return BlockStored(block.block_hash, block.parent_hash, PS, block.token_bytes, block.extra_keys)


@pytest.fixture
def publisher():
    made = []

    def make(extra: str = "", snapshot=None, **kw) -> KVEventPublisher:
        pub = KVEventPublisher(parse_kv_events_config(ON % extra), topic="kv@pod-1@m",
                               block_size=PS, snapshot=snapshot, **kw)
        pub.start()
        made.append(pub)
        return pub

    yield make
    for pub in made:
        pub.stop()


def _sub(pub: KVEventPublisher) -> Subscriber:
    sub = Subscriber(pub.endpoint)
    time.sleep(0.2)  # a SUB that just connected misses what is sent before the handshake
    return sub


def _settle(pub: KVEventPublisher, sub: Subscriber, batches: int) -> None:
    wait_for(lambda: pub.status.batches >= batches, 10, f"{batches} batches published")
    while sub.drain(100):
        pass


def test_chains_removals_and_the_llm_d_rules(publisher):
    pub = publisher()
    wait_for(lambda: pub.status.batches == 1, 10, "the first batch (AllBlocksCleared)")
    sub = _sub(pub)
    chain = _chain(list(range(1, 13)))  # 3 full blocks
    for block in chain:
        pub.pool_sink(_stored(block))
    _settle(pub, sub, 2)
    message = sub.decoded[0]
    assert (message.pod, message.model, message.seq) == ("pod-1", "m", 1)
    (event,) = message.events  # one chain in one BlockStored
    assert event[0] == "stored" and event[2] is None  # block 0's parent: none, as vLLM
    assert event[1] == [wire.u64(b.block_hash) for b in chain]
    assert event[3] == list(range(1, 13)) and event[4] == PS and event[5] == "GPU"
    # u64: the xxh3-128 key's last 8 bytes, big-endian (the parent cut the same way)
    assert wire.u64(chain[1].block_hash) == int.from_bytes(chain[1].block_hash[8:], "big")
    more = _chain(list(range(1, 17)))[3]
    pub.pool_sink(_stored(more))
    pub.pool_sink(BlockRemoved(chain[2].block_hash))
    pub.pool_sink(BlockRemoved(b"\1" * 16))  # never published: nothing to take back
    _settle(pub, sub, 3)
    stored, removed = sub.decoded[1].events
    assert stored[2] == wire.u64(chain[2].block_hash)
    assert removed == ("removed", [wire.u64(chain[2].block_hash)], "GPU")
    assert sub.index.held() == {wire.u64(b.block_hash) for b in (*chain[:2], more)}
    # the decoder's rules bite: a short token list, a bad topic, two frames
    bad = wire.EventBatch(0.0, [wire.BlockStored([1, 2], None, [1] * 5, PS, None, "GPU", None)], 0)
    with pytest.raises(Rejected, match="token-length"):
        decode_message([b"kv@p@m", wire.seq_bytes(0), wire.encode_batch(bad)])
    with pytest.raises(Rejected, match="topic"):
        decode_message([b"kv.p", wire.seq_bytes(0), wire.encode_batch(bad)])
    with pytest.raises(Rejected, match="3 frames"):
        decode_message([b"kv@p@m", wire.seq_bytes(0)])


def test_salted_blocks_are_omitted_unless_asked(publisher):
    private = _chain(list(range(100, 112)), tenant="alpha")
    salted = _chain(list(range(200, 212)), cache_salt="s3cret")
    public = _chain(list(range(300, 312)))
    for publish_salted, pub in ((False, publisher()),
                                (True, publisher(', "salted_blocks": "publish"'))):
        wait_for(lambda pub=pub: pub.status.batches == 1, 10, "the first batch")
        sub = _sub(pub)
        for block in (*private, *salted, *public):
            pub.pool_sink(_stored(block))
        for block in (private[1], salted[2]):
            pub.pool_sink(BlockRemoved(block.block_hash))
        _settle(pub, sub, 2)
        published_tokens = {t for tokens in sub.index.tokens.values() for t in tokens}
        assert set(range(300, 312)) <= published_tokens
        leaked = published_tokens & (set(range(100, 112)) | set(range(200, 212)))
        if publish_salted:
            assert leaked and sub.index.held() == {
                wire.u64(b.block_hash) for b in (private[0], private[2], *salted[:2], *public)}
        else:  # not a token, not a hash, not a removal of a salted block
            assert not leaked and pub.status.omitted_salted == 8
            assert sub.index.held() == {wire.u64(b.block_hash) for b in public}
        sub.close()


def test_tier_media_and_a_block_moving_between_them(publisher):
    pub = publisher()
    wait_for(lambda: pub.status.batches == 1, 10, "the first batch")
    sub = _sub(pub)
    host_stored, host_removed = pub.tier_sinks("CPU")
    chain = _chain(list(range(1, 9)))
    secret = _chain(list(range(50, 58)), tenant="beta")
    for block in (*chain, *secret):
        pub.pool_sink(_stored(block))
    for block in (*chain, *secret):  # evicted from the pool, spilled to the host tier
        pub.pool_sink(BlockRemoved(block.block_hash))
        host_stored(block)
    _settle(pub, sub, 2)
    assert sub.index.held("GPU") == set()
    assert sub.index.held("CPU") == {wire.u64(b.block_hash) for b in chain}  # beta's stay private
    host_removed(chain[0].block_hash)  # the tier evicted it
    _settle(pub, sub, 3)
    assert sub.index.held("CPU") == {wire.u64(chain[1].block_hash)}


def test_a_full_queue_resyncs_and_a_late_subscriber_replays(publisher):
    blocks = _chain(list(range(1, 41)))  # 10 blocks
    pool = []
    pub = publisher(', "max_queue_size": 3', snapshot=lambda: list(pool))
    wait_for(lambda: pub.status.batches == 1, 10, "the first batch")
    with pub._flush_lock:  # hold the thread: the queue fills past its bound
        for block in blocks:
            pool.append(block)
            pub.pool_sink(_stored(block))
    wait_for(lambda: pub.status.resyncs == 2, 10, "a resync after the overflow")
    assert pub.status.dropped == len(blocks) - 3
    # a subscriber joining now replays from 0 and ends where a live one would be
    late = replay(pub.replay_endpoint, 0)
    index = Index()
    for seq, payload in late:
        index.apply(decode_message([b"kv@pod-1@m", seq, payload]))
    assert index.held() == {wire.u64(b.block_hash) for b in blocks}
    assert index.next_seq == pub.status.batches  # contiguous from 0, nothing missing


@pytest.mark.parametrize("tier", ["host", "redis"])
def test_second_tiers_publish_with_their_medium(publisher, tier, request):
    """A KVTier over each store, attached as a server attaches it: a spilled block is stored in
    the tier's medium; one the store drops (its LRU) is removed from it."""
    import types

    import torch

    from prefixgate.cache.tier import HostTier, TierEntry, entry_slot_bytes
    from prefixgate.engine.kv_tier import KVTier, pool_layout

    chain = _chain(list(range(1, 13)))
    kv_pool = torch.zeros(1, 2, 4, PS, 1, 2)  # [L, 2, pages, ps, Hkv, D]
    page_bytes = kv_pool[:, :, 0].numel() * kv_pool.element_size()
    slot = entry_slot_bytes(page_bytes, 512)
    if tier == "host":
        store, medium = HostTier(2 * slot, slot), "CPU"  # room for two entries
    else:
        from prefixgate.gateway.scaleout.kv_tier_redis import MAC_BYTES, RedisTier

        redis_server = request.getfixturevalue("redis_server")
        entry = len(TierEntry(chain[1], pool_layout(kv_pool), bytes(page_bytes)).encode())
        store, medium = RedisTier(redis_server.url, entry * 5 // 2 + 2 * MAC_BYTES,
                                  namespace="kvevents-tier", secret="s" * 16), "REDIS"
    kv_tier = KVTier(store, kv_pool)
    pub = publisher()
    engine = types.SimpleNamespace(core=types.SimpleNamespace(tier=kv_tier),
                                   add_event_sink=lambda sink: None)
    pub.attach(engine)
    wait_for(lambda: pub.status.batches == 1, 10, "the first batch")
    sub = _sub(pub)
    for block in chain:  # evicted from the pool, in chain order
        pub.pool_sink(_stored(block))
    kv_tier.spill([(i, block) for i, block in enumerate(chain)])
    kv_tier.flush()
    _settle(pub, sub, 2)
    # the store keeps two: the first block was dropped again, as its LRU says
    assert sub.index.held(medium) == {wire.u64(b.block_hash) for b in chain[1:]}
    assert sub.index.held("GPU") == {wire.u64(b.block_hash) for b in chain}
    kv_tier.close()


def test_a_broken_sink_never_raises_into_the_engine(publisher):
    """The sinks run inside the pool's register/evict on the engine thread: whatever goes
    wrong there costs a resync, never an exception into the step."""
    pub = publisher()
    wait_for(lambda: pub.status.batches == 1, 10, "the first batch")
    with pub._flush_lock:  # the thread waits while the queue is broken
        queue, pub._queue = pub._queue, None  # anything the sink touches, broken
        pub.pool_sink(_stored(_chain(list(range(1, 5)))[0]))
        stored, removed = pub.tier_sinks("CPU")
        stored(_chain(list(range(1, 5)))[0])
        removed(b"\0" * 16)
        assert pub.status.errors == 3 and pub._overflowed
        pub._queue = queue
    wait_for(lambda: pub.status.resyncs == 2, 10, "the resync after the failure")
