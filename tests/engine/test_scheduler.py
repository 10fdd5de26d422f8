"""Scheduler logic with no model: the 'runner' is just commit + a fixed next token."""

import pytest

from prefixgate.cache import KVCacheManager
from prefixgate.engine.api import SamplingParams
from prefixgate.engine.scheduler import Scheduler
from prefixgate.engine.sequence import SeqStatus, Sequence
from prefixgate.engine.step_budget import settings_as_given


def make_scheduler(cache, *, connector=None, drafter=None, pacer=None, clock=None, **settings):
    """A Scheduler with these settings (EngineConfig fields, the budgets exactly as given)."""
    config, budgets = settings_as_given(settings)
    extra = {"clock": clock} if clock is not None else {}
    return Scheduler(cache, config, budgets=budgets, connector=connector, drafter=drafter,
                     pacer=pacer, **extra)


def seq(tokens, rid=None):
    return Sequence(request_id=rid or f"r{id(tokens)}", choice=0, token_ids=list(tokens),
                    num_prompt_tokens=len(tokens), sampling=SamplingParams(), extra_keys=b"",
                    tenant="t", agent=None)


def step(s: Scheduler, next_token=1):
    out = s.schedule()
    s.commit(out)
    for c in out.chunks:
        if c.need_logits and c.seq.status is SeqStatus.RUNNING:
            s.append_token(c.seq, next_token)
    s.cache.check_integrity()
    return out


def test_chunked_prefill_respects_the_budget():
    s = make_scheduler(KVCacheManager(64, 4, watermark=0), max_num_batched_tokens=32)
    a = seq(range(100))
    s.add(a)
    sizes = []
    for _ in range(4):
        out = step(s)
        sizes.append([(c.num_tokens, c.need_logits) for c in out.chunks])
    assert sizes == [[(32, False)], [(32, False)], [(32, False)], [(4, True)]]
    assert len(a.token_ids) == 101  # sampled once, after the last chunk


def test_decodes_are_packed_before_prefill_chunks():
    s = make_scheduler(KVCacheManager(128, 4, watermark=0), max_num_batched_tokens=20)
    short = [seq([i] * 5, rid=f"s{i}") for i in range(3)]
    for x in short:
        s.add(x)
    step(s)  # three 5-token prefills
    long = seq(range(1000, 1100), rid="long")
    s.add(long)
    out = step(s)
    assert [(c.seq.request_id, c.num_tokens) for c in out.chunks] == [
        ("s0", 1), ("s1", 1), ("s2", 1), ("long", 17)]
    assert out.num_tokens == 20


def test_watermark_holds_admission():
    s = make_scheduler(KVCacheManager(10, 4, watermark=0.2), max_num_batched_tokens=1000)
    a, b = seq(range(16), "a"), seq(range(100, 120), "b")  # 4 and 5 pages
    s.add(a)
    s.add(b)
    out = step(s)
    assert [c.seq.request_id for c in out.chunks] == ["a"]  # b would leave 1 < 2 free
    assert s.num_waiting == 1


def test_idle_engine_admits_below_the_watermark_but_never_beyond_the_pool():
    s = make_scheduler(KVCacheManager(10, 4, watermark=0.5), max_num_batched_tokens=1000)
    big, huge = seq(range(36), "big"), seq(range(100, 150), "huge")
    s.add(huge)
    s.add(big)
    out = step(s)
    assert [x.request_id for x in out.unschedulable] == ["huge"]
    assert [c.seq.request_id for c in out.chunks] == ["big"]
    # more pages than the whole pool: failed at once, even while others run, and it does not
    # hold up the queue behind it
    s2 = make_scheduler(KVCacheManager(10, 4, watermark=0), max_num_batched_tokens=1000, admission_order="fcfs")
    s2.add(seq(range(8), "small"))
    step(s2)
    s2.add(seq(range(100, 150), "huge"))
    s2.add(seq(range(200, 204), "next"))
    out = step(s2)
    assert [x.request_id for x in out.unschedulable] == ["huge"]
    assert [c.seq.request_id for c in out.chunks] == ["small", "next"]


def test_preemption_takes_the_latest_admitted_and_requeues_it_first():
    cache = KVCacheManager(6, 2, watermark=0)
    s = make_scheduler(cache, max_num_batched_tokens=100)
    a, b = seq([1, 2, 3], "a"), seq([4, 5, 6], "b")
    s.add(a)
    s.add(b)
    step(s)  # a: pages for 3 tokens (2), b: 2 -> 4 used
    step(s)  # each decodes 1 token: position 3 in page 2 of each -> still 4 pages
    assert cache.num_free_pages == 2
    step(s)  # each needs a 3rd page: 2 free -> fine
    assert cache.num_free_pages == 0
    step(s)
    out = step(s)  # positions 6: a needs a 4th page; b (latest) is preempted
    assert s.num_preemptions >= 1 and b.status is SeqStatus.WAITING and s.waiting[0] is b
    assert all(c.seq is a for c in out.chunks)
    s.finish(a)
    for _ in range(3):
        step(s)
    assert b.status is SeqStatus.RUNNING and b.num_computed == len(b.token_ids) - 1
    assert b.num_cached_tokens == 0  # usage keeps the first admission's hit


def test_abort_releases_pages_at_once():
    cache = KVCacheManager(16, 4, watermark=0)
    s = make_scheduler(cache)
    a, w = seq(range(10), "a"), seq(range(50, 60), "w")
    s.add(a)
    step(s)
    s.add(w)
    assert cache.stats().pages_used == 3
    assert [x.request_id for x in s.remove_request("a")] == ["a"]
    assert cache.stats().pages_used == 0 and s.num_running == 0
    assert [x.request_id for x in s.remove_request("w")] == ["w"] and s.num_waiting == 0
    cache.check_integrity()


def test_burst_with_a_cold_shared_prefix_computes_it_once():
    cache = KVCacheManager(256, 4, watermark=0)
    s = make_scheduler(cache, max_num_batched_tokens=4096)
    system = list(range(400))
    burst = [seq(system + [1000 + i] * 5, f"a{i}") for i in range(8)]
    for x in burst:
        s.add(x)
    computed = 0
    while any(x.status is not SeqStatus.RUNNING or x.num_computed < x.num_prompt_tokens for x in burst):
        out = step(s)
        computed += sum(c.num_tokens for c in out.chunks if c.start_pos < c.seq.num_prompt_tokens)
    # the 400-token prefix once + each agent's 5-token suffix
    assert computed == 400 + 8 * 5
    assert [x.num_cached_tokens for x in burst] == [0] + [400] * 7
    assert s.num_dedup_waits >= 7


def test_dedup_off_computes_the_prefix_for_everyone():
    cache = KVCacheManager(1024, 4, watermark=0)
    s = make_scheduler(cache, max_num_batched_tokens=4096, enable_dedup=False)
    burst = [seq(list(range(400)) + [1000 + i] * 5, f"a{i}") for i in range(4)]
    for x in burst:
        s.add(x)
    out = step(s)
    assert out.num_tokens == 4 * 405


@pytest.mark.parametrize("bad", [dict(max_num_batched_tokens=0), dict(max_num_seqs=0)])
def test_bad_config(bad):
    with pytest.raises(ValueError):
        make_scheduler(KVCacheManager(4, 4), **bad)


def test_a_deferred_request_is_hashed_once_and_extended_after_preemption():
    s = make_scheduler(KVCacheManager(64, 4, watermark=0), max_num_batched_tokens=4096)
    a, b = seq(list(range(40)) + [1], "a"), seq(list(range(40)) + [2], "b")
    s.add(a)
    s.add(b)
    step(s)  # b is deferred: a computes the shared blocks
    assert len(b.block_hashes) == 10 and b.block_hashes == s.cache.hasher.hash_blocks(b.token_ids)
    first = b.block_hashes[0]
    step(s)
    assert b.status is SeqStatus.RUNNING and b.block_hashes[0] is first  # not recomputed
    b.token_ids += [7, 7, 7]
    assert len(s.cache.block_hashes(b)) == 11 and b.block_hashes == s.cache.hasher.hash_blocks(b.token_ids)


def test_forked_decodes_beyond_the_budget_all_advance():
    """n > 1 forks can put more sequences in `running` than the step budget has tokens; every
    decode still advances each step (none waits for older ones to finish)."""
    s = make_scheduler(KVCacheManager(64, 4, watermark=0), max_num_batched_tokens=4, max_num_seqs=4)
    parent = seq(range(10), "p")
    s.add(parent)
    while parent.num_computed < parent.num_prompt_tokens:
        step(s)
    children = [seq(parent.token_ids, f"c{i}") for i in range(5)]
    for child in children:
        s.fork(parent, child)
    late = seq(range(50, 60), "late")
    s.add(late)
    for _ in range(3):
        out = step(s)
        assert sorted(c.seq.request_id for c in out.chunks) == ["c0", "c1", "c2", "c3", "c4", "p"]
        assert all(c.num_tokens == 1 for c in out.chunks)
    # no budget left for prefill and no room to admit: the late request waits
    assert late.status is SeqStatus.WAITING


def test_the_budget_counts_a_chunks_attention_over_its_context():
    # context_scale 100: n tokens from position s cost n * (1 + (s + n/2) / 100)
    s = make_scheduler(KVCacheManager(512, 4, watermark=0), max_num_batched_tokens=100, context_scale=100)
    a = seq(range(1000))
    s.add(a)
    sizes = [step(s).chunks[0].num_tokens for _ in range(3)]
    # 73 * (1 + 36.5/100) = 99.6 <= 100 < 74 * 1.37; then from 73: 50 * (1 + 98/100) = 99
    assert sizes[:2] == [73, 50]
    for start, n in ((0, 73), (73, 50), (123, sizes[2])):
        assert s.costs.cost(start, n) <= 100 < s.costs.cost(start, n + 1)
    # deep into a long context one token may cost more than the whole budget: still progress
    deep = make_scheduler(KVCacheManager(2048, 4, watermark=0), max_num_batched_tokens=2, context_scale=1)
    b = seq(range(3000))
    deep.add(b)
    assert [step(deep).chunks[0].num_tokens for _ in range(2)] == [1, 1]
    # without a scale every token costs one (the stand-in runners' budget)
    plain = make_scheduler(KVCacheManager(512, 4, watermark=0), max_num_batched_tokens=100)
    plain.add(seq(range(1000)))
    assert step(plain).chunks[0].num_tokens == 100


def test_a_short_prompt_is_not_split_to_fill_a_steps_leftover():
    # arrival order (lpm would rank these cold prompts shortest first)
    s = make_scheduler(KVCacheManager(256, 4, watermark=0), max_num_batched_tokens=40, admission_order="fcfs")
    first, second, third = seq(range(30), "first"), seq(range(100, 125), "second"), seq(range(200, 210), "third")
    for x in (first, second, third):
        s.add(x)
    out = step(s)
    # second would get 10 of its 25 tokens here and its first token a step later: it waits,
    # and FIFO holds (third, which would fit, is not admitted ahead of it)
    assert [(c.seq.request_id, c.num_tokens) for c in out.chunks] == [("first", 30)]
    out = step(s)
    assert [(c.seq.request_id, c.num_tokens) for c in out.chunks] == [
        ("first", 1), ("second", 25), ("third", 10)]
    # with only decodes in the step, a prompt longer than what is left is chunked into it
    long = seq(range(300, 400), "long")
    s.add(long)
    out = step(s)
    assert [(c.seq.request_id, c.num_tokens) for c in out.chunks][-1] == ("long", 37)
    # and next to another prefill too: waiting for a step of its own would not help it
    s2 = make_scheduler(KVCacheManager(256, 4, watermark=0), max_num_batched_tokens=40)
    s2.add(seq(range(30), "p"))
    s2.add(seq(range(500, 600), "big"))
    assert [(c.seq.request_id, c.num_tokens) for c in step(s2).chunks] == [("p", 30), ("big", 10)]



def test_a_crumb_of_leftover_budget_admits_nothing():
    # 192 with C = 3072: a 3,000-token prompt takes 186 tokens (191.6 units); the 0.4 left
    # must not admit a second long prompt for one token a step
    s = make_scheduler(KVCacheManager(2048, 16, watermark=0), max_num_batched_tokens=192, context_scale=3072)
    s.add(seq(range(3000), "l1"))
    s.add(seq(range(10_000, 14_000), "l2"))
    for _ in range(3):
        out = step(s)
        assert [c.seq.request_id for c in out.chunks] == ["l1"]
        assert s.costs.cost(out.chunks[0].start_pos, out.chunks[0].num_tokens) <= 192
    assert s.num_waiting == 1 and s.num_running == 1  # l2 holds no pages, no running slot


def test_a_bounced_prompt_keeps_its_place_behind_dedup_deferred_ones():
    s = make_scheduler(KVCacheManager(512, 4, watermark=0), max_num_batched_tokens=40, context_scale=1000)
    shared = list(range(500, 520))
    s.add(seq(shared + [1], "cold"))  # computes the shared blocks
    s.add(seq(shared + [2], "dup"))  # deferred by dedup while they are in flight
    s.add(seq(range(900, 925), "short"))  # 25 tokens: would be split into the leftover
    out = s.schedule()
    assert [c.seq.request_id for c in out.chunks] == ["cold"]
    assert [x.request_id for x in s.waiting] == ["dup", "short"]  # order kept


def test_a_large_free_hit_is_not_counted_twice_against_the_pool():
    # 9 of 10 pages, 8 of them a free cached hit: it waits for `other`, it is not failed
    s = make_scheduler(KVCacheManager(10, 4, watermark=0), max_num_batched_tokens=1000)
    hist = seq(range(32), "hist")
    s.add(hist)
    step(s)
    s.finish(hist)
    other = seq(range(500, 508), "other")
    s.add(other)
    step(s)  # 3 pages (its decode took hist's last block): 7 free, 8 would be needed
    back = seq([*range(32), 1, 2, 3, 4], "back")
    s.add(back)
    assert step(s).unschedulable == () and s.waiting[0] is back
    s.finish(other)
    out = step(s)
    assert [c.seq.request_id for c in out.chunks] == ["back"] and back.num_cached_tokens == 28
