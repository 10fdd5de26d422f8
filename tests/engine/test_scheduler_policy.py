"""Scheduling policy with no model: the adaptive step budget, waiting requests keeping their
hit, cache-aware admission with an age bound (docs/scheduling.md)."""

from prefixgate.cache import KVCacheManager
from prefixgate.engine.scheduler import Scheduler
from tests.engine.test_scheduler import make_scheduler, seq, step


def test_the_budget_is_big_until_a_stream_decodes_then_bounded():
    s = make_scheduler(KVCacheManager(256, 4, watermark=0), max_num_batched_tokens=64,
                  decode_step_budget=16)
    short, long = seq(range(8), "short"), seq(range(100, 300), "long")
    s.add(short)
    s.add(long)
    assert s.step_budget() == 64  # nothing decodes: the backlog runs in big chunks
    out = step(s)
    assert [(c.seq.request_id, c.num_tokens) for c in out.chunks] == [("short", 8), ("long", 56)]
    assert s.step_budget() == 16  # short decodes now: its next token waits for this step
    out = step(s)
    assert [(c.seq.request_id, c.num_tokens) for c in out.chunks] == [("short", 1), ("long", 15)]
    s.finish(short)
    assert s.step_budget() == 64
    assert [c.num_tokens for c in step(s).chunks] == [64]


def test_a_short_prefill_goes_before_a_long_prompts_next_chunk():
    s = make_scheduler(KVCacheManager(256, 4, watermark=0), max_num_batched_tokens=32)
    long = seq(range(100, 300), "long")
    s.add(long)
    step(s)  # long's first chunk: it runs now
    short = seq(range(8), "short")
    s.add(short)
    out = step(s)
    # whole and first: its first token is this step's, not after long's 5 remaining chunks
    assert [(c.seq.request_id, c.num_tokens) for c in out.chunks] == [("short", 8), ("long", 24)]
    too_big = seq(range(400, 440), "too_big")  # 40 tokens: never whole in 32, waits its turn
    s.add(too_big)
    out = step(s)
    assert [c.seq.request_id for c in out.chunks] == ["short", "long"]
    assert [x.request_id for x in s.waiting] == ["too_big"]


def test_a_short_prefill_runs_whole_in_a_decode_step_a_long_one_in_small_chunks():
    s = make_scheduler(KVCacheManager(256, 4, watermark=0), max_num_batched_tokens=256,
                  decode_step_budget=8, short_prefill_budget=40)
    streamer = seq(range(4), "streamer")
    s.add(streamer)
    step(s)  # streamer decodes from now on: the step budget is 8
    turn, prompt = seq(range(10, 40), "turn"), seq(range(500, 600), "prompt")
    s.add(turn)
    s.add(prompt)
    out = step(s)
    # the 30-token turn fits the widened 40 whole: one step to its first token; the 100-token
    # prompt does not: it gets the page the short pass leaves, then the decode budget's chunks
    assert [(c.seq.request_id, c.num_tokens) for c in out.chunks] == [
        ("streamer", 1), ("turn", 30), ("prompt", 4)]
    out = step(s)
    assert [(c.seq.request_id, c.num_tokens) for c in out.chunks] == [
        ("streamer", 1), ("turn", 1), ("prompt", 6)]


def test_only_one_short_prefill_a_step_widens_it():
    s = make_scheduler(KVCacheManager(256, 4, watermark=0), max_num_batched_tokens=256,
                  decode_step_budget=8, short_prefill_budget=80, admission_order="fcfs")
    streamer = seq(range(4), "streamer")
    s.add(streamer)
    step(s)
    turns = [seq(range(10 * i + 100, 10 * i + 130), f"turn{i}") for i in range(2)]
    tiny = seq(range(300, 304), "tiny")
    for x in (*turns, tiny):
        s.add(x)
    out = step(s)
    # turn0 widens the step to 80; turn1 (it would fit 80 too) would stretch it again (everyone
    # in the step waits for both): it goes whole in the next step
    assert [(c.seq.request_id, c.num_tokens) for c in out.chunks] == [("streamer", 1), ("turn0", 30)]
    out = step(s)
    # (tiny fits the page the short pass leaves for the prefill work behind it)
    assert [(c.seq.request_id, c.num_tokens) for c in out.chunks] == [
        ("streamer", 1), ("turn0", 1), ("turn1", 30), ("tiny", 4)]
    s2 = make_scheduler(KVCacheManager(256, 4, watermark=0), max_num_batched_tokens=256,
                   decode_step_budget=16, short_prefill_budget=40, admission_order="fcfs")
    s2.add(seq(range(4), "streamer"))
    step(s2)
    s2.add(seq(range(10, 16), "a"))  # 6 tokens: within the step's own 15 left
    s2.add(seq(range(20, 28), "b"))  # 8 more: still within it
    assert [(c.seq.request_id, c.num_tokens) for c in step(s2).chunks] == [
        ("streamer", 1), ("a", 6), ("b", 8)]


def _streaming_scheduler(now: list[float]) -> Scheduler:
    """A scheduler with short-prefill widening and a 5 s age bound on ``now``, one stream
    already decoding."""
    s = make_scheduler(KVCacheManager(512, 4, watermark=0), max_num_batched_tokens=256,
                  decode_step_budget=8, short_prefill_budget=40, max_admission_wait_s=5.0,
                  clock=lambda: now[0])
    s.add(seq(range(4), "streamer"))
    step(s)
    return s


def test_short_turns_pass_an_aged_long_prompt_but_never_starve_it():
    now = [0.0]
    s = _streaming_scheduler(now)
    long = seq(range(1000, 1200), "long")
    s.add(long)
    now[0] = 10.0  # long waited past the age bound: it heads the queue
    progress = []
    for i in range(6):  # a short turn arrives every step
        s.add(seq(range(2000 + 100 * i, 2000 + 100 * i + 20), f"turn{i}"))
        out = step(s)
        chunks = {c.seq.request_id: c.num_tokens for c in out.chunks}
        assert chunks.get(f"turn{i}") == 20  # the turn passes the long prompt, whole
        progress.append(chunks.get("long", 0))
    assert all(n >= 4 for n in progress)  # and the long prompt moves at least a page a step


def test_many_decodes_leave_a_prefill_at_least_a_page_a_step():
    s = make_scheduler(KVCacheManager(256, 4, watermark=0), max_num_batched_tokens=256,
                  decode_step_budget=4, short_prefill_budget=1)
    streams = [seq(range(10 * i, 10 * i + 3), f"s{i}") for i in range(6)]
    for x in streams:
        s.add(x)
    step(s)
    prompt = seq(range(500, 600), "prompt")
    s.add(prompt)
    assert s.step_budget() == 6 + 4  # six decodes exceed the budget of 4: one page on top
    out = step(s)
    assert [(c.seq.request_id, c.num_tokens) for c in out.chunks][-1] == ("prompt", 4)


def test_srpt_admits_the_least_prefill_compute_first():
    now = [0.0]
    s = lpm_scheduler(now)
    s.admission_order = "srpt"
    long_hit = seq([*range(16), *range(80, 92)], "long_hit")  # 16 cached, 12 to compute
    short_cold = seq(range(200, 206), "short_cold")  # nothing cached, 6 to compute
    s.add(long_hit)
    s.add(short_cold)
    out = step(s)
    assert [(c.seq.request_id, c.num_tokens) for c in out.chunks][0] == ("short_cold", 6)
    now[0] = 10.0  # past the age bound: arrival order again
    s2 = lpm_scheduler(now)
    s2.admission_order = "srpt"
    first, later = seq(range(300, 307), "first"), seq(range(400, 403), "later")
    s2.add(first)
    now[0] = 20.0
    s2.add(later)
    assert [c.seq.request_id for c in step(s2).chunks][0] == "first"


def test_the_decode_budget_never_exceeds_the_step_budget():
    s = make_scheduler(KVCacheManager(8, 4), max_num_batched_tokens=32, decode_step_budget=100)
    assert s.decode_step_budget == 32
    assert make_scheduler(KVCacheManager(8, 4), max_num_batched_tokens=32).decode_step_budget == 32


def evicting_scenario(protect: bool):
    """``back`` waits while ``big`` (admitted first, the budget spent) takes 8 of the 12 pages:
    6 hashless ones, then two cached ones. Which two: ``first``'s (that ``back`` would hit,
    and the LRU's oldest) or ``other``'s?"""
    s = make_scheduler(KVCacheManager(12, 4, watermark=0), max_num_batched_tokens=16,
                  protect_waiting=protect, admission_order="fcfs")
    for name, tokens in (("first", range(12)), ("other", range(500, 512))):
        done = seq(tokens, name)
        s.add(done)
        step(s)
        s.finish(done)  # 3 free-but-cached pages each, released tail first
    big = seq(range(100, 132), "big")
    s.add(big)
    back = seq([*range(12), *range(50, 70)], "back")  # 20 uncached tokens: never whole in 16
    s.add(back)
    for _ in range(2):  # big's two 16-token chunks; back waits for budget
        out = step(s)
        assert [c.seq.request_id for c in out.chunks] == ["big"]
    s.finish(big)
    assert [c.seq.request_id for c in step(s).chunks] == ["back"]
    return s, back


def test_a_waiting_request_keeps_its_hit_while_others_take_pages():
    s, back = evicting_scenario(protect=True)
    assert back.num_cached_tokens == 12 and s.cache.stats().protected_evicted == 0
    assert s.cache.stats().pages_protected == 0  # released once admitted


def test_without_protection_the_lru_evicts_the_waiting_requests_hit():
    _, back = evicting_scenario(protect=False)
    assert back.num_cached_tokens == 4  # first's blocks 2 and 1 went to big, tail first


def test_aborting_or_preempting_a_waiting_request_keeps_the_holds_consistent():
    cache = KVCacheManager(6, 2, watermark=0)
    s = make_scheduler(cache, max_num_batched_tokens=100)
    a, b = seq([1, 2, 3], "a"), seq([4, 5, 6], "b")
    s.add(a)
    s.add(b)
    for _ in range(4):
        step(s)
    out = step(s)  # positions 6: a needs a 4th page; b (the latest admitted) is preempted
    assert [x.request_id for x in out.preempted] == ["b"]
    # b's 3 freed full blocks are its own prefix when it returns: protected, but soft: a's
    # 4th page took one (nothing else was free)
    assert cache.stats().pages_protected == 2 and cache.stats().protected_evicted == 1
    s.remove_request("b")
    assert cache.stats().pages_protected == 0 and cache.pool.held_counts() == {}
    cache.check_integrity()


def lpm_scheduler(now):
    cache = KVCacheManager(64, 4, watermark=0)
    s = make_scheduler(cache, max_num_batched_tokens=8, admission_order="lpm",
                  max_admission_wait_s=10.0, clock=lambda: now[0])
    warm = seq(range(16), "warm")
    s.add(warm)
    for _ in range(3):
        step(s)
    s.finish(warm)
    return s


def test_lpm_admits_the_longest_cached_prefix_first():
    now = [0.0]
    s = lpm_scheduler(now)
    cold, half, full = seq(range(200, 206), "cold"), seq([*range(8), 70, 71], "half"), \
        seq([*range(16), 80, 81], "full")
    for x in (cold, half, full):
        s.add(x)
    out = step(s)
    assert [c.seq.request_id for c in out.chunks] == ["full", "half"]
    assert [x.request_id for x in s.waiting] == ["cold"]


def test_lpm_breaks_equal_prefixes_by_least_prefill_compute():
    now = [0.0]
    s = lpm_scheduler(now)
    long_cold, short_cold = seq(range(200, 207), "long_cold"), seq(range(300, 303), "short_cold")
    s.add(long_cold)  # arrived first, nothing cached on either: the shorter one goes first
    s.add(short_cold)
    full = seq([*range(16), 80, 81], "full")  # a cached prefix still beats both
    s.add(full)
    out = step(s)
    assert [c.seq.request_id for c in out.chunks] == ["full", "short_cold"]
    assert [x.request_id for x in s.waiting] == ["long_cold"]


def test_lpm_never_starves_a_request_past_the_age_bound():
    now = [0.0]
    s = lpm_scheduler(now)
    cold = seq(range(200, 206), "cold")
    s.add(cold)
    now[0] = 10.0
    full = seq([*range(16), 80, 81], "full")
    s.add(full)
    out = step(s)
    assert [c.seq.request_id for c in out.chunks][0] == "cold"  # waited 10 s: it goes first


def test_fcfs_keeps_arrival_order():
    now = [0.0]
    s = lpm_scheduler(now)
    s.admission_order = "fcfs"  # (the default is lpm)
    cold, full = seq(range(200, 206), "cold"), seq([*range(16), 80, 81], "full")
    s.add(cold)
    s.add(full)
    assert [c.seq.request_id for c in step(s).chunks][0] == "cold"


def test_a_prompt_just_under_the_widened_step_is_not_starved_by_short_turns():
    # 37 tokens: under the widened step (40 - 1 decode) but over what the short pass leaves
    # (less the reserved page: 35); it must be chunked beside the short turns, not wait
    # for a step with no other prefill (which a stream of short turns never leaves)
    now = [0.0]
    s = _streaming_scheduler(now)
    mid = seq(range(1000, 1037), "mid")
    s.add(mid)
    now[0] = 10.0  # aged: it heads the queue
    for i in range(3):
        s.add(seq(range(2000 + 100 * i, 2000 + 100 * i + 4), f"turn{i}"))
        out = step(s)
        assert [(c.seq.request_id, c.num_tokens) for c in out.chunks][-1] == ("mid", 4)


def test_short_turns_passing_a_prompt_leave_it_its_pages_and_its_slot():
    # a stream of 4-token turns (2-3 pages each while they decode) passes the 48-token prompt
    # at the head (never whole in the short pass): it must not take the 12 pages and the
    # running slot the prompt waits for, step after step
    now = [0.0]
    s = make_scheduler(KVCacheManager(20, 4, watermark=0), max_num_batched_tokens=64, max_num_seqs=5,
                  decode_step_budget=8, short_prefill_budget=16, max_admission_wait_s=5.0,
                  clock=lambda: now[0])
    big = seq(range(1000, 1048), "big")
    for i in range(30):
        s.add(seq(range(2000 + 100 * i, 2000 + 100 * i + 4), f"turn{i}"))
        if i == 5:
            s.add(big)
            now[0] += 10.0  # aged at once: it heads the queue
        out = step(s)
        for c in out.chunks:
            if c.seq.request_id.startswith("turn") and c.seq.num_output_tokens >= 6:
                s.finish(c.seq)
        if big.admitted_order >= 0:
            break
    assert big.admitted_order >= 0 and i <= 10, f"admitted: {big.admitted_order >= 0}, step {i}"


def test_a_prompt_deeper_than_a_page_of_budget_still_moves_beside_short_turns():
    # with a small context scale one token deep in the prompt costs more than the page the
    # short pass keeps back: the oldest running prefill still takes a token every step
    s = make_scheduler(KVCacheManager(512, 4, watermark=0), max_num_batched_tokens=64,
                  decode_step_budget=8, short_prefill_budget=40, context_scale=10)
    s.add(seq(range(4), "streamer"))
    step(s)
    long = seq(range(1000, 1300), "long")
    s.add(long)
    for _ in range(10):
        step(s)  # long gets going
    done = long.num_computed
    for i in range(6):  # a short turn every step
        s.add(seq(range(2000 + 10 * i, 2000 + 10 * i + 3), f"turn{i}"))
        step(s)
    assert long.num_computed >= done + 6
