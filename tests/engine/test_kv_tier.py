"""The second KV tier on the real engine: evicted pages spill to the tier and a returning
session loads them back instead of recomputing; greedy output is identical with a tier hit,
a corrupt entry, a hash collision and a plain recompute (invariants 8 and 9, docs/design.md)."""

from __future__ import annotations

import logging

import pytest
import torch

from prefixgate.cache.tier import HostTier, entry_slot_bytes
from prefixgate.engine import build as factory
from prefixgate.engine.api import GenerationRequest
from prefixgate.engine.config import EngineConfig, auto_tier_bytes
from tests.engine.test_engine import SYSTEM, TASKS, chat, greedy, run, tokens

PROMPT = SYSTEM + " " + SYSTEM + " Plan the release checklist."


def _tier_engine(make_engine, **overrides):
    engine = make_engine(num_pages=24, watermark=0.0, **overrides)
    pool = engine.runner.kv_pool
    page_bytes = pool[:, :, 0].numel() * pool.element_size()
    return engine, page_bytes


def _session(engine, tokenizer, flush=None) -> tuple[list[int], object]:
    """Turn 1, other agents' traffic evicting it, turn 2: (turn 2's tokens, its last delta)."""
    paused = chat(tokenizer, PROMPT)
    first = run(engine, [GenerationRequest(paused, greedy(4), request_id="turn1")])["turn1"]
    others = [chat(tokenizer, f"{i}: {TASKS[i]} " * 14) for i in range(3)]
    run(engine, [GenerationRequest(p, greedy(2), request_id=f"o{i}") for i, p in enumerate(others)])
    if flush is not None:
        flush()
    back = run(engine, [GenerationRequest(paused, greedy(8), request_id="turn2")])["turn2"]
    assert tokens(first) == tokens(back)[:4]
    engine.scheduler.cache.check_integrity()
    return tokens(back), back[-1]


def test_a_tier_hit_loads_the_evicted_prefix_with_identical_output(make_engine, tokenizer):
    plain = make_engine(num_pages=24, watermark=0.0)
    plain_out, plain_last = _session(plain, tokenizer)

    engine, page_bytes = _tier_engine(make_engine)
    store = HostTier(64 * entry_slot_bytes(page_bytes), entry_slot_bytes(page_bytes))
    from prefixgate.engine.kv_tier import KVTier

    # a long deadline: on a loaded CI box a late load would (correctly) recompute
    engine.attach_tier(KVTier(store, engine.runner.kv_pool, load_timeout_s=30.0))
    out, last = _session(engine, tokenizer, flush=engine.tier.flush)
    prompt = len(chat(tokenizer, PROMPT))
    stats = engine.tier.stats()
    assert out == plain_out  # invariant 9: a tier load never changes what a sequence reads
    assert stats.pages_spilled > 0 and stats.hits == 1 and stats.pages_loaded > 0
    assert last.usage.cached_tokens >= (prompt - 1) // 16 * 16  # every full block came back
    assert plain_last.usage.cached_tokens <= last.usage.cached_tokens - 3 * 16
    assert engine.tier_tokens_loaded == stats.pages_loaded * 16


def test_tier_round_trip_is_byte_identical(make_engine):
    engine, page_bytes = _tier_engine(make_engine)
    from prefixgate.cache.hashing import HashedBlock
    from prefixgate.engine.kv_tier import KVTier

    pool = engine.runner.kv_pool
    store = HostTier(8 * entry_slot_bytes(page_bytes), entry_slot_bytes(page_bytes))
    tier = KVTier(store, pool)
    generator = torch.Generator().manual_seed(0)
    pool[:, :, 3] = torch.randn(pool[:, :, 3].shape, generator=generator)
    original = pool[:, :, 3].clone()
    block = HashedBlock(b"h" * 16, b"p" * 16, bytes(64), b"tenant")
    tier.spill([(3, block)])
    tier.flush()
    tier.request("k", 0, [block])
    while (load := tier.poll("k")) is None:
        pass
    tier.write([5], load.payload, 0)
    assert torch.equal(pool[:, :, 5], original)  # bit for bit
    # a forced collision: same hash, other tokens (or another tenant's salt) -> nothing served
    for other in (block._replace(token_bytes=bytes([1]) + bytes(63)), block._replace(extra_keys=b"other")):
        tier.request("c", 0, [other])
        while (load := tier.poll("c")) is None:
            pass
        assert load.blocks == () and load.payload is None
    # a flipped byte anywhere in the stored entry -> checksum fails, entry dropped, recompute
    slot, length = store._slots[block.block_hash]
    store._arena[slot * store.slot_bytes + length - 7] ^= 0x01
    tier.request("x", 0, [block])
    while (load := tier.poll("x")) is None:
        pass
    stats = tier.stats()
    assert load.blocks == () and stats.corrupt == 1 and stats.rejected == 2
    assert not store.may_contain(block.block_hash)
    tier.close()


def test_an_entry_of_another_pool_dtype_is_never_loaded():
    """An entry spilled from an fp32 pool does not load into a bf16 pool of the same shape (nor
    the reverse): the layout tag carries the dtype, and the payload size differs too."""
    from prefixgate.cache.hashing import HashedBlock
    from prefixgate.engine.kv_tier import KVTier, pool_layout

    fp32 = torch.randn(2, 2, 4, 16, 3, 64)
    bf16 = torch.zeros(fp32.shape, dtype=torch.bfloat16)
    assert pool_layout(fp32) != pool_layout(bf16)
    assert pool_layout(fp32).replace(b"float32", b"bfloat16") == pool_layout(bf16)
    slot = entry_slot_bytes(fp32[:, :, 0].numel() * fp32.element_size())
    store = HostTier(8 * slot, slot)
    writer, reader = KVTier(store, fp32), KVTier(store, bf16)
    block = HashedBlock(b"h" * 16, b"p" * 16, bytes(64), b"tenant")
    writer.spill([(1, block)])
    writer.flush()
    reader.request("r", 0, [block])
    while (load := reader.poll("r")) is None:
        pass
    assert load.blocks == () and load.payload is None
    assert reader.stats().rejected == 1 and store.may_contain(block.block_hash)
    # the fp32 pool still loads its own entry
    writer.request("w", 0, [block])
    while (load := writer.poll("w")) is None:
        pass
    assert load.blocks == (block,) and torch.equal(load.payload[:, :, 0], fp32[:, :, 1])
    # and a bf16 pool's entry does not load into the fp32 pool
    other = block._replace(block_hash=b"g" * 16)
    reader.spill([(2, other)])
    reader.flush()
    writer.request("x", 0, [other])
    while (load := writer.poll("x")) is None:
        pass
    assert load.blocks == () and writer.stats().rejected == 1
    writer.close()
    reader.close()


def _slow_host_tier(delay_s: float, pages: int, page_bytes: int):
    import threading

    from prefixgate.cache.tier import HostTier, entry_slot_bytes

    store = HostTier(pages * entry_slot_bytes(page_bytes), entry_slot_bytes(page_bytes))
    gate = threading.Event()
    real_put = store.put

    def put(key, blob):
        gate.wait(delay_s)
        return real_put(key, blob)

    store.put = put
    return store, gate


def test_a_load_right_after_an_eviction_waits_for_its_spill():
    import time

    import torch

    from prefixgate.cache.hashing import HashedBlock
    from prefixgate.engine.kv_tier import KVTier

    pool = torch.randn(2, 2, 8, 4, 2, 8)
    page_bytes = pool[:, :, 0].numel() * pool.element_size()
    store, gate = _slow_host_tier(5.0, 8, page_bytes)
    tier = KVTier(store, pool, load_timeout_s=5.0)
    blocks = [HashedBlock(bytes([i]) * 16, bytes([i + 1]) * 16, bytes(16), b"t") for i in range(3)]
    tier.spill([(i, b) for i, b in enumerate(blocks)])
    assert tier.may_contain(blocks[0]) is True and not store.may_contain(blocks[0].block_hash)
    tier.request("k", 0, blocks)
    time.sleep(0.05)
    assert tier.poll("k") is None  # waiting on the spill
    gate.set()
    began = time.monotonic()
    while (load := tier.poll("k")) is None:
        time.sleep(0.001)
    assert time.monotonic() - began < 2
    assert len(load.blocks) == 3 and torch.equal(load.payload, pool[:, :, :3])
    assert tier._spilling == {}  # noqa: SLF001
    tier.close()


def test_a_failed_spill_write_releases_its_blocks():
    import torch

    from prefixgate.cache.hashing import HashedBlock
    from prefixgate.cache.tier import HostTier, entry_slot_bytes
    from prefixgate.engine.kv_tier import KVTier

    pool = torch.randn(2, 2, 8, 4, 2, 8)
    page_bytes = pool[:, :, 0].numel() * pool.element_size()
    store = HostTier(8 * entry_slot_bytes(page_bytes), entry_slot_bytes(page_bytes))

    def put(key, blob):
        raise ConnectionError("store down")

    store.put = put
    tier = KVTier(store, pool, load_timeout_s=5.0)
    block = HashedBlock(b"a" * 16, b"b" * 16, bytes(16), b"t")
    tier.spill([(0, block), (1, block)])  # the same block twice in one spill
    tier.flush()
    assert tier._spilling == {}  # noqa: SLF001
    assert tier.stats().spills_dropped == 2
    tier.close()


def test_auto_sizes_the_host_tier_from_available_ram():
    gib = 1 << 30
    # a quarter of what is available, at most the cap; off below two pools or when unknown
    assert auto_tier_bytes(20 * gib, 4.0, gib) == 4 * gib
    assert auto_tier_bytes(10 * gib, 4.0, gib) == int(2.5 * gib)
    assert auto_tier_bytes(6 * gib, 4.0, gib) == 0  # 1.5 GiB would not hold two pools
    assert auto_tier_bytes(None, 4.0, gib) == 0
    with pytest.raises(ValueError, match="kv_tier must be one of"):
        EngineConfig(kv_tier="disk")


def test_an_auto_tier_is_built_and_logged(make_engine, monkeypatch, caplog):
    monkeypatch.setattr(factory, "available_ram_bytes", lambda: 64 << 20)
    with caplog.at_level(logging.INFO, logger=factory.__name__):
        engine = make_engine(num_pages=8, kv_tier="auto", kv_tier_size_gb=1.0)
    assert engine.tier is not None and "KV tier (auto): host, 0.02 GiB" in caplog.text
    monkeypatch.setattr(factory, "available_ram_bytes", lambda: None)
    with caplog.at_level(logging.INFO, logger=factory.__name__):
        assert make_engine(num_pages=8, kv_tier="auto").tier is None
    assert "KV tier (auto): off" in caplog.text


def test_a_container_limit_bounds_the_ram_the_auto_tier_sees(monkeypatch):
    gib = 1 << 30
    monkeypatch.setattr(factory, "_meminfo_available", lambda: 100 * gib)  # the host's
    files = {"/sys/fs/cgroup/memory.max": 8 * gib, "/sys/fs/cgroup/memory.current": 5 * gib}
    monkeypatch.setattr(factory, "_read_int", files.get)
    assert factory.available_ram_bytes() == 3 * gib  # the container may take 3 GiB more
    files["/sys/fs/cgroup/memory.max"] = None  # "max": no limit
    assert factory.available_ram_bytes() == 100 * gib
