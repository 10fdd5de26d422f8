"""KV events from a live gateway on the real default model: what a subscriber following the
stream (decoded by llm-d's rules) believes equals what the pool and the host tier hold, through
evictions, spills to the host tier and back, a cache reset and a subscriber that joins late
(replay); a cache_salt's blocks never reach it."""

from __future__ import annotations

import time

import httpx
import pytest

from prefixgate.engine.config import EngineConfig
from prefixgate.gateway.scaleout.kv_events import wire
from prefixgate.gateway.scaleout.kv_events.config import parse_kv_events_config
from prefixgate.gateway.server import ServerSettings
from tests.live_gateway import live_servers
from tests.scaleout.conftest import PAGE_SIZE, wait_for
from tests.scaleout.kv_events_decoder import Index, Subscriber, decode_message, replay

pytestmark = pytest.mark.slow

CONFIG = ('{"enable_kv_cache_events": true, "publisher": "zmq", '
          '"endpoint": "tcp://127.0.0.1:*", "replay_endpoint": "tcp://127.0.0.1:*"}')


@pytest.fixture(scope="module")
def replica(loaded_model):
    from prefixgate.engine.async_engine import build_engine

    # 20 pages of 16 tokens: a few prompts evict; a host tier of ~13 pages spills and drops
    engine = build_engine(EngineConfig(num_pages=20, page_size=PAGE_SIZE, max_waiting=32,
                                       kv_tier="host", kv_tier_size_gb=0.01),
                          loaded=loaded_model)
    settings = ServerSettings(host="127.0.0.1", port=0, log_level="warning",
                              kv_events=parse_kv_events_config(CONFIG))
    with live_servers(engine, [settings]) as servers:
        yield servers[0], engine


def _truth(engine) -> tuple[set[int], set[int]]:
    engine.core.tier.flush()
    pool = {wire.u64(h) for h in engine.cached_block_hashes()}
    host = {wire.u64(h) for h in list(engine.core.tier.store._slots)}
    return pool, host


def _caught_up(server, engine, sub: Subscriber) -> str:
    """Empty once the subscriber holds exactly what the replica holds (else the difference)."""
    publisher = server.config.app.state.kv_events
    sub.drain(100)
    pool, host = _truth(engine)
    if (sub.index.held("GPU"), sub.index.held("CPU")) == (pool, host) and not len(publisher._queue):
        return ""
    return (f"GPU {len(pool)} held / {len(sub.index.held('GPU'))} believed, CPU {len(host)} / "
            f"{len(sub.index.held('CPU'))}; {publisher.status}")


def _complete(client: httpx.Client, prompt: str, **extra) -> None:
    model = client.get("/v1/models").json()["data"][0]["id"]
    reply = client.post("/v1/completions", json={"model": model, "prompt": prompt,
                                                  "max_tokens": 1, "temperature": 0, **extra})
    reply.raise_for_status()


def test_the_stream_follows_the_pool_and_the_host_tier(replica):
    server, engine = replica
    publisher = server.config.app.state.kv_events
    wait_for(lambda: publisher.status.batches >= 1, 10, "the first batch")
    sub = Subscriber(publisher.endpoint)
    time.sleep(0.2)
    # it joined after seq 0: a gap to fill from the replay socket, as llm-d's subscriber would
    for seq, payload in replay(publisher.replay_endpoint, 0):
        sub.index.apply(decode_message([publisher.topic.encode(), seq, payload]))
    docs = [f"Document {i}: " + " ".join(f"w{i}x{j}" for j in range(40)) for i in range(6)]
    with httpx.Client(base_url=server.base_url, timeout=120) as client:
        for doc in docs:  # each ~5 blocks: the 20-page pool evicts, the host tier fills
            _complete(client, doc)

        def caught() -> bool:
            return not _caught_up(server, engine, sub)

        wait_for(caught, 20, "the subscriber to follow pool and tier")
        pool, host = _truth(engine)
        assert host and engine.core.tier.stats().pages_spilled > len(host) > 0  # tier evicted
        for doc in reversed(docs[:-1]):  # the latest evicted: back from the host tier
            _complete(client, doc)
            if engine.core.tier.stats().pages_loaded:
                break
        assert engine.core.tier.stats().pages_loaded > 0
        wait_for(caught, 20, "the subscriber after a tier load")
        # a cache_salt's blocks are private: none of its tokens reach the subscriber
        salted = "Salted secret " + " ".join(f"s{j}" for j in range(60))
        _complete(client, salted, cache_salt="tenant-secret")
        ids = engine.tokenizer.encode(salted)
        secret_blocks = {tuple(ids[i : i + PAGE_SIZE])
                         for i in range(0, len(ids) - PAGE_SIZE + 1, PAGE_SIZE)}
        sub.drain(200)
        assert publisher.status.omitted_salted >= len(secret_blocks) > 2
        assert not secret_blocks & {tuple(tokens) for tokens in sub.index.tokens.values()}
        client.post("/v1/cache/reset").raise_for_status()
        wait_for(caught, 20, "the subscriber after a cache reset")
        assert not sub.index.held("GPU") and sub.index.held("CPU")  # reset: the pool only
    # a subscriber joining now: replay from 0 rebuilds the same view, seq contiguous
    late = Index()
    for seq, payload in replay(publisher.replay_endpoint, 0):
        late.apply(decode_message([publisher.topic.encode(), seq, payload]))
    assert late.blocks == sub.index.blocks and late.next_seq == publisher.status.batches
    assert all(m.pod and m.model == server.config.app.state.server.model_name for m in sub.decoded)
    sub.close()


def test_metrics_carry_the_publisher_counters(replica):
    """/metrics shows the publisher's own counters (published, omitted, dropped, resyncs)."""
    from prometheus_client.parser import text_string_to_metric_families

    server, _ = replica
    publisher = server.config.app.state.kv_events
    with httpx.Client(base_url=server.base_url, timeout=120) as client:
        _complete(client, "Metrics note: " + " ".join(f"m{j}" for j in range(40)))
        wait_for(lambda: publisher.status.stored > 0, 10, "a published block")
        text = client.get("/metrics").text
    values = {sample.name: sample.value for family in text_string_to_metric_families(text)
              for sample in family.samples if sample.name.startswith("prefixgate:kv_events_")}
    status = publisher.status
    assert values["prefixgate:kv_events_stored_blocks_total"] > 0
    assert values["prefixgate:kv_events_resyncs_total"] >= 1  # the first batch is one
    for name in ("batches", "stored_blocks", "removed_blocks", "omitted_salted", "dropped",
                 "resyncs", "replays", "errors"):
        assert f"prefixgate:kv_events_{name}_total" in values, name
    # counters only grow: what was read before the scrape is a lower bound
    assert values["prefixgate:kv_events_batches_total"] <= status.batches
