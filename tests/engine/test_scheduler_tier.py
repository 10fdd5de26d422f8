"""The scheduler's side of the second KV tier, with stand-in tiers (pure scheduling logic):
a finished load waits on its request and is installed only in the step that admits it, and
a request that waits is looked up in the tier again when the pool's hit changed under it."""

from __future__ import annotations

import random

import pytest

from prefixgate.cache import KVCacheManager
from prefixgate.engine.api import SamplingParams
from prefixgate.engine.kv_connector import KVConnector
from prefixgate.engine.kv_tier import TierLoad
from prefixgate.engine.scheduler import Scheduler
from prefixgate.engine.sequence import SeqStatus, Sequence
from tests.engine.test_scheduler import make_scheduler, seq, step

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
    tier = StandInTier()
    return make_scheduler(cache, max_num_batched_tokens=1000, connector=KVConnector(cache, tier)), tier


def tier_step(s: Scheduler, tier: StandInTier):
    """One step as the engine runs it: evicted pages go to the tier before anything else."""
    out = step(s)
    tier.spill(s.cache.take_evicted())
    s.cache.loads_written()
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
    assert tier.requests == [(0, 3)] and s.connector.probe(back) == "loading"
    out = tier_step(s, tier)  # loaded, but no page is free: held, nothing installed
    assert out.page_loads == () and s.connector.probe(back) == "held" and s.num_waiting == 1
    assert s.cache.find_prefix(back.token_ids).num_cached_tokens == 0
    s.finish(other)
    out = tier_step(s, tier)
    assert [c.seq.request_id for c in out.chunks] == ["turn2"]
    (load,) = out.page_loads
    assert load.payload == "payload from 0" and load.offset == 0 and len(load.page_ids) == 3
    assert back.num_cached_tokens == 12 and out.chunks[0].start_pos == 12
    assert tier.requests == [(0, 3)]  # one load, installed once
    assert s.connector.load_pages == {}


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
    assert s.connector.probe(back) == "held" and s.connector.load_pages == {back.seq_id: 3}
    s.remove_request("turn2")
    assert s.connector.probe(back) == "" and s.connector.load_pages == {}


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


# ------------------------------------------------------------------ randomized, content-tracked
# A stand-in tier whose loads finish after a random number of polls, and a record of which
# block each page's K/V really is: no chunk may read a page before its load is written, no
# spill may carry anything but its block, and held loads are accounted exactly.


class SlowTier:
    """Stand-in tier: a load finishes after a random number of polls; payload = block hashes."""

    def __init__(self, rng: random.Random, contents: dict[int, bytes | None]) -> None:
        self.rng = rng
        self.contents = contents
        self.store: dict[bytes, bytes] = {}
        self.inflight: dict[object, list] = {}

    def spill(self, evicted) -> None:
        for page_id, block in evicted:
            held = self.contents.get(page_id)
            assert held == block.block_hash, f"spilled page {page_id}: holds {held!r}, not its block"
            self.store[block.block_hash] = held

    def may_contain(self, block):
        return block.block_hash in self.store

    def request(self, key, start_block, blocks) -> None:
        assert key not in self.inflight
        self.inflight[key] = [self.rng.randint(0, 2), start_block, tuple(blocks)]

    def poll(self, key):
        entry = self.inflight[key]
        if entry[0] > 0:
            entry[0] -= 1
            return None
        del self.inflight[key]
        _, start, blocks = entry
        found = []
        for block in blocks:
            if block.block_hash not in self.store:
                break
            found.append(block)
        return TierLoad(start, tuple(found), tuple(b.block_hash for b in found))

    def cancel(self, key) -> None:
        self.inflight.pop(key, None)


def make_seq(tokens, rid, max_tokens):
    return Sequence(request_id=rid, choice=0, token_ids=list(tokens), num_prompt_tokens=len(tokens),
                    sampling=SamplingParams(max_tokens=max_tokens), extra_keys=b"", tenant="t",
                    agent=None)


def run_random(seed: int, num_pages: int = 24, steps: int = 300, extras: bool = False) -> None:
    rng = random.Random(seed)
    cache = KVCacheManager(num_pages, PAGE, watermark=rng.choice([0, 0.1]) if extras else 0)
    contents: dict[int, bytes | None] = {}  # page id -> hash of the block its K/V really is
    tier = SlowTier(rng, contents)
    s = make_scheduler(cache, max_num_batched_tokens=rng.choice([8, 16, 64]), connector=KVConnector(cache, tier),
                  max_num_seqs=rng.choice([2, 4, 8]))
    histories = {f"sess{i}": [*range(8), *range(100 * i, 100 * i + rng.randint(1, 12))] for i in range(6)}
    live: dict[str, Sequence] = {}
    turn = 0
    for _ in range(steps):
        # new turns
        for name, hist in histories.items():
            if name not in live and rng.random() < 0.3:
                turn += 1
                sq = make_seq(hist, f"{name}#{turn}", rng.randint(1, 6))
                live[name] = sq
                s.add(sq)
        out = s.schedule()
        # the engine: spill evicted pages (their content must be their block), then write loads
        tier.spill(cache.take_evicted())
        for load in out.page_loads:
            for i, page_id in enumerate(load.page_ids):
                contents[page_id] = load.payload[load.offset + i]
        cache.loads_written()
        for src, dst in out.copy_pairs:
            contents[dst] = contents.get(src)
        # what each chunk reads: every full block before its start must hold that block
        for c in out.chunks:
            blocks = cache.block_hashes(c.seq)
            for b in range(c.start_pos // PAGE):
                page_id = c.block_table[b]
                assert contents.get(page_id) == blocks[b].block_hash, (
                    f"seed {seed}: {c.seq.request_id} reads block {b} from page {page_id} holding "
                    f"{contents.get(page_id)!r}")
            # the chunk writes its tokens: pages it touches hold its blocks once full
            end = c.start_pos + c.num_tokens
            for b in range(c.start_pos // PAGE, -(-end // PAGE)):
                page_id = c.block_table[b]
                contents[page_id] = blocks[b].block_hash if (b + 1) * PAGE <= end and b < len(blocks) else None
        s.commit(out)
        for c in out.chunks:
            if c.need_logits and c.seq.status is SeqStatus.RUNNING:
                s.append_token(c.seq, 7000 + rng.randint(0, 3))
                if c.seq.num_output_tokens >= c.seq.sampling.max_tokens:
                    s.finish(c.seq)
        for gone in out.unschedulable:
            live.pop(gone.request_id.split("#")[0], None)
        # finished: the conversation grows
        for name, sq in list(live.items()):
            if sq.status is SeqStatus.FINISHED:
                if extras and rng.random() < 0.3:
                    cache.retain(sq.token_ids, b"", rng.choice([0.0001, 100.0]), max_pages=num_pages // 3)
                if extras and rng.random() < 0.05:
                    cache.pin(sq.token_ids[:8], b"")
                histories[name] = [*sq.token_ids, *range(5000 + turn, 5000 + turn + rng.randint(1, 9))]
                del live[name]
            elif rng.random() < 0.03:  # client gone
                s.remove_request(sq.request_id)
                del live[name]
        cache.check_integrity()
        waiting_ids = {w.seq_id for w in s.waiting if s.connector.probe(w) in ("loading", "held")}
        assert set(s.connector.load_pages) == waiting_ids, (seed, s.connector.load_pages, waiting_ids)  # noqa: SLF001
        assert all(s.connector.probe(r) == "" for r in s.running)  # forgotten once admitted
        assert set(tier.inflight) <= {w.seq_id for w in s.waiting if s.connector.probe(w) == "loading"}


@pytest.mark.parametrize("seed", range(25))
def test_random_tier_workload_never_reads_an_unwritten_page(seed):
    run_random(seed)


@pytest.mark.parametrize("seed", range(25))
def test_random_tier_workload_with_retention_pins_and_watermark(seed):
    run_random(seed, extras=True)
