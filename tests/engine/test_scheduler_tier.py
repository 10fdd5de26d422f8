"""The scheduler's side of the second KV tier, with a stand-in tier (pure scheduling logic):
a finished load waits on its request and is installed only in the step that admits it, and
a request that waits is looked up in the tier again when the pool's hit changed under it."""

from __future__ import annotations

from prefixgate.cache import KVCacheManager
from prefixgate.gateway.engine.kv_tier import TierLoad
from prefixgate.gateway.engine.scheduler import Scheduler
from tests.engine.test_scheduler import seq, step

PAGE = 4


class StandInTier:
    """Holds every spilled block; a requested load is finished at the next poll."""

    def __init__(self) -> None:
        self.blocks: dict[bytes, object] = {}
        self.requests: list[tuple[int, int]] = []  # (start block, blocks asked)
        self._finished: dict[object, TierLoad] = {}

    def spill(self, evicted) -> None:
        for _, block in evicted:
            self.blocks[block.block_hash] = block

    def may_contain(self, block) -> bool:
        return block.block_hash in self.blocks

    def request(self, key, start_block, blocks) -> None:
        self.requests.append((start_block, len(blocks)))
        found = []
        for block in blocks:
            if block.block_hash not in self.blocks:
                break
            found.append(block)
        self._finished[key] = TierLoad(start_block, tuple(found), f"payload from {start_block}")

    def poll(self, key):
        return self._finished.pop(key)

    def cancel(self, key) -> None:
        self._finished.pop(key, None)


def tier_scheduler(num_pages: int) -> tuple[Scheduler, StandInTier]:
    cache = KVCacheManager(num_pages, PAGE, watermark=0)
    cache.capture_evictions()
    tier = StandInTier()
    return Scheduler(cache, max_num_batched_tokens=1000, tier=tier), tier


def tier_step(s: Scheduler, tier: StandInTier):
    """One step as the engine runs it: evicted pages go to the tier before anything else."""
    out = step(s)
    tier.spill(s.cache.take_evicted())
    return out


def test_a_finished_load_waits_for_admission_instead_of_sitting_in_the_pool():
    s, tier = tier_scheduler(8)
    first = seq(range(12), "turn1")  # 3 full blocks
    s.add(first)
    tier_step(s, tier)
    s.finish(first)
    other = seq(range(100, 130), "other")  # 8 pages: evicts turn 1's three
    s.add(other)
    tier_step(s, tier)
    assert len(tier.blocks) == 3 and s.cache.num_free_pages == 0
    back = seq([*range(12), 50, 51, 52, 53], "turn2")
    s.add(back)
    out = tier_step(s, tier)  # probe: the load starts, the request waits for it
    assert tier.requests == [(0, 3)] and back.tier_probe == "loading"
    out = tier_step(s, tier)  # loaded, but no page is free: held, nothing installed
    assert out.page_loads == () and back.tier_probe == "held" and s.num_waiting == 1
    assert s.cache.find_prefix(back.token_ids).num_cached_tokens == 0
    s.finish(other)
    out = tier_step(s, tier)
    assert [c.seq.request_id for c in out.chunks] == ["turn2"]
    (load,) = out.page_loads
    assert load.payload == "payload from 0" and load.offset == 0 and len(load.page_ids) == 3
    assert back.num_cached_tokens == 12 and out.chunks[0].start_pos == 12
    assert tier.requests == [(0, 3)]  # one load, installed once
    assert s._tier_load_pages == {}


def test_a_waiting_request_looks_again_when_the_pool_loses_its_prefix():
    s, tier = tier_scheduler(8)
    first = seq(range(12), "turn1")
    s.add(first)
    tier_step(s, tier)
    s.finish(first)  # 3 free cached pages, released tail first
    other = seq(range(100, 120), "other")  # 5 pages, then one more per 4 decoded tokens
    s.add(other)
    tier_step(s, tier)
    back = seq([*range(12), 50, 51, 52, 53], "turn2")  # needs 4 pages, 3 are free
    s.add(back)
    for _ in range(12):  # `other` decodes, evicting turn 1's pages one by one into the tier
        tier_step(s, tier)
        if s.num_waiting == 0:
            break
    assert s.num_waiting == 1 and len(tier.blocks) == 3
    assert len(tier.requests) >= 2  # looked again each time the pool's hit shrank
    s.finish(other)
    out = tier_step(s, tier)
    if out.chunks == ():  # the last look's load lands this step
        out = tier_step(s, tier)
    assert [c.seq.request_id for c in out.chunks] == ["turn2"]
    assert back.num_cached_tokens == 12  # every block came back, none recomputed
    assert sum(len(load.page_ids) for load in out.page_loads) == 3
    s.cache.check_integrity()


def test_an_aborted_request_releases_its_held_load():
    s, tier = tier_scheduler(8)
    first = seq(range(12), "turn1")
    s.add(first)
    tier_step(s, tier)
    s.finish(first)
    other = seq(range(100, 130), "other")
    s.add(other)
    tier_step(s, tier)
    back = seq([*range(12), 50, 51, 52, 53], "turn2")
    s.add(back)
    tier_step(s, tier)
    tier_step(s, tier)
    assert back.tier_probe == "held" and s._tier_load_pages == {back.seq_id: 3}
    s.remove_request("turn2")
    assert back.tier_load is None and s._tier_load_pages == {}


def test_installing_a_load_never_evicts_the_pool_hit_it_continues():
    s, tier = tier_scheduler(8)
    first = seq(range(12), "turn1")
    s.add(first)
    tier_step(s, tier)
    s.finish(first)  # free queue: 5 hashless pages, then turn 1's blocks 2, 1, 0 (tail first)
    other = seq(range(100, 128), "other")  # 7 pages: the hashless ones, then blocks 2 and 1
    s.add(other)
    tier_step(s, tier)
    s.finish(other)  # block 0 is now the least recently used free page
    assert len(tier.blocks) == 2
    back = seq([*range(12), 50, 51, 52, 53], "turn2")
    s.add(back)
    tier_step(s, tier)  # pool hit: block 0; the load: blocks 1 and 2
    assert tier.requests == [(1, 2)]
    out = tier_step(s, tier)
    (load,) = out.page_loads
    assert len(load.page_ids) == 2 and back.num_cached_tokens == 12
    assert s.cache.block_table(back.seq_id)[:3] == [*s.cache.block_table(back.seq_id)[:1], *load.page_ids]
