"""Randomized scheduling with no model (seeded, bounded): shared prefixes (dedup, holds), decoding
streams, aborts, preemption under a small pool, a fake clock past the age bound, every admission
order. After every step: the cache's invariants, each chunk continuing its sequence exactly where
the last one ended, the step's compute within its budget, and no request left at the head of the
queue for long; at the end, every request finished, aborted or reported unschedulable."""

from __future__ import annotations

import random

import pytest

from prefixgate.cache import KVCacheManager
from prefixgate.engine.api import SamplingParams
from prefixgate.engine.scheduler import Scheduler
from prefixgate.engine.sequence import SeqStatus, Sequence
from tests.engine.test_scheduler import make_scheduler

PAGE = 4
ARRIVAL_STEPS = 80  # requests arrive during these steps, then the engine drains
STEP_CAP = 600  # everything is done by then
HEAD_STEPS = 20  # the longest a request may stay at the head of the queue (12 at most in these seeds)


def make_request(rng: random.Random, rid: str, systems: list[list[int]], unique: int) -> Sequence:
    prefix = rng.choice(systems) if rng.random() < 0.7 else []
    length = rng.randint(40, 90) if rng.random() < 0.25 else rng.randint(1, 30)
    tokens = [*prefix, *range(unique, unique + length)]
    return Sequence(request_id=rid, choice=0, token_ids=tokens, num_prompt_tokens=len(tokens),
                    sampling=SamplingParams(max_tokens=rng.randint(1, 6)), extra_keys=b"",
                    tenant="t", agent=None)


def step_bound(s: Scheduler, step_budget: int, decodes: int) -> int:
    """What a step may compute, read off the code (no context scale: a token costs 1): the step
    budget, widened by one short prefill to ``short_prefill_budget``; while streams decode, the
    decodes (never skipped) plus the page the short-prefill pass leaves to the prefill work
    behind it, even when the decodes alone exceed the budget."""
    widened = max(step_budget, s.short_prefill_budget)
    return max(widened, decodes + PAGE) if decodes else widened


def run(seed: int) -> None:
    rng = random.Random(seed)
    now = [0.0]
    cache = KVCacheManager(rng.randint(14, 40), PAGE, watermark=rng.choice([0, 0.1]))
    s = make_scheduler(cache, max_num_batched_tokens=rng.choice([24, 48, 96]),
                  decode_step_budget=rng.choice([None, 8, 12]),
                  short_prefill_budget=rng.choice([None, 16, 40]),
                  max_num_seqs=rng.choice([3, 6, 12]), admission_order=rng.choice(["lpm", "srpt", "fcfs"]),
                  max_admission_wait_s=5.0, clock=lambda: now[0])
    systems = [list(range(10_000 * k, 10_000 * k + PAGE * rng.randint(2, 8))) for k in (1, 2, 3)]
    live: dict[str, Sequence] = {}
    frontier: dict[int, int] = {}  # seq id -> where its next chunk must start (-1: re-admitted)
    head: tuple[int, int] = (-1, 0)  # (seq id at the queue head, steps it has been there)
    for number in range(STEP_CAP):
        if number < ARRIVAL_STEPS and rng.random() < 0.5:
            rid = f"r{number}"
            live[rid] = make_request(rng, rid, systems, 1000 * (number + 1))
            s.add(live[rid])
        if not s.has_work():
            if number >= ARRIVAL_STEPS:
                break
            continue
        budget = s.step_budget()
        decoding = {x.seq_id for x in s.running if x.num_uncomputed == 1}
        out = s.schedule()
        ids = [c.seq.seq_id for c in out.chunks]
        assert len(ids) == len(set(ids)), f"seed {seed}: a sequence scheduled twice in one step"
        for gone in out.preempted:
            frontier[gone.seq_id] = -1  # recomputed from its hit when it returns
        for c in out.chunks:
            expected = frontier.get(c.seq.seq_id, -1)
            # first chunk after (re)admission: from the hit, a block boundary or one short of all
            assert expected in (-1, c.start_pos), f"seed {seed}: {c.seq} chunk at {c.start_pos}, not {expected}"
            assert expected != -1 or c.start_pos % PAGE == 0 or c.start_pos == len(c.seq.token_ids) - 1
            assert c.start_pos + c.num_tokens <= len(c.seq.token_ids)
            assert c.need_logits == (c.start_pos + c.num_tokens == len(c.seq.token_ids))
            frontier[c.seq.seq_id] = c.start_pos + c.num_tokens
        decodes = sum(1 for c in out.chunks if c.seq.seq_id in decoding)
        assert out.num_tokens <= step_bound(s, budget, decodes), (
            f"seed {seed} step {number}: {out.num_tokens} tokens, budget {budget}, {decodes} decodes")
        s.commit(out)
        for c in out.chunks:
            if c.need_logits and c.seq.status is SeqStatus.RUNNING:
                s.append_token(c.seq, 7)
                if c.seq.num_output_tokens >= c.seq.sampling.max_tokens:
                    s.finish(c.seq)
                    del live[c.seq.request_id]
        for gone in out.unschedulable:
            # no pins here: only a request whose own pages (a copy-on-write one included) are
            # more than the whole pool can never fit
            assert -(-len(gone.token_ids) // PAGE) + 1 > cache.num_pages, f"seed {seed}: {gone} failed"
            del live[gone.request_id]
        if live and rng.random() < 0.03:  # a client goes away
            rid = rng.choice(sorted(live))
            s.remove_request(rid)
            del live[rid]
        now[0] += 1.0
        cache.check_integrity()
        first = s.waiting[0].seq_id if s.waiting else -1
        head = (first, head[1] + 1 if first == head[0] else 1)
        assert first == -1 or head[1] <= HEAD_STEPS, f"seed {seed}: {s.waiting[0]} at the head for {head[1]} steps"
    assert not live and not s.has_work(), f"seed {seed}: {sorted(live)} not done after {STEP_CAP} steps"
    assert cache.stats().pages_used == 0 and cache.pool.held_counts() == {}


@pytest.mark.parametrize("seed", range(40))
def test_random_workload_keeps_every_invariant_and_starves_no_one(seed):
    run(seed)
