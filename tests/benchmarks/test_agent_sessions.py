"""benchmarks.agent_sessions, the pure parts: the seeded workload, the pause distribution, the
pool sizing arithmetic and the report's ratios (no server, no tokenizer)."""

import math
import random

import pytest

from benchmarks import agent_sessions as bench


def test_plan_is_deterministic_given_the_seed():
    workload = bench.Workload(agents=6, turns=4, system_tokens=200, tools=3)
    first, again = bench.make_plan(workload), bench.make_plan(workload)
    assert first == again
    other = bench.make_plan(bench.Workload(agents=6, turns=4, system_tokens=200, tools=3, seed=1))
    assert [a.pauses_s for a in other.agents] != [a.pauses_s for a in first.agents]
    assert len(first.agents) == 6
    assert all(len(a.pauses_s) == 3 for a in first.agents)  # after turns 1..T-1
    assert all(0 <= a.start_s < workload.stagger_s for a in first.agents)
    assert [t["function"]["name"] for t in first.tools] == [spec[0] for spec in bench.texts.TOOLS[:3]]
    # the tool results are seeded per agent and turn
    assert (bench.tool_result_text(workload, 2, 1, "search_logs")
            == bench.tool_result_text(workload, 2, 1, "search_logs"))
    assert (bench.tool_result_text(workload, 2, 1, "search_logs")
            != bench.tool_result_text(workload, 3, 1, "search_logs"))


def test_pause_free_plan_keeps_everything_but_the_pauses():
    workload = bench.Workload(agents=4, turns=3)
    paused, free = bench.make_plan(workload), bench.make_plan(workload, pause_scale=0.0)
    assert all(p == 0 for a in free.agents for p in a.pauses_s)
    assert [(a.task, a.start_s) for a in free.agents] == [(a.task, a.start_s) for a in paused.agents]


def test_pauses_are_clipped_heavy_tailed_and_scaled():
    rng = random.Random(0)
    pauses = [bench.draw_pause(rng) for _ in range(20_000)]
    assert min(pauses) >= bench.PAUSE_MIN_S and max(pauses) <= bench.PAUSE_MAX_S
    assert min(pauses) == bench.PAUSE_MIN_S and max(pauses) == bench.PAUSE_MAX_S  # both clips bite
    median = sorted(pauses)[len(pauses) // 2]
    assert median == pytest.approx(bench.PAUSE_MEDIAN_S, rel=0.05)
    assert sum(pauses) / len(pauses) > 1.3 * median  # the heavy tail pulls the mean up
    scaled = [bench.draw_pause(random.Random(0), 2.5) for _ in range(3)]
    assert scaled[0] == pytest.approx(2.5 * bench.draw_pause(random.Random(0)))


def test_pool_size_counts_the_shared_prefix_once():
    # shared 100 tokens = 6 full pages (+4 tokens that are not shared); two agents of 260, 180
    size = bench.pool_size(100, [260, 180], 0.4, 16)
    assert size.working_set_tokens == 100 + 160 + 80
    assert size.working_set_pages == 6 + math.ceil(164 / 16) + math.ceil(84 / 16)  # 6 + 11 + 6
    assert size.num_pages == math.ceil(0.4 * 23) and not size.floor_applied
    floored = bench.pool_size(100, [260, 180], 0.4, 16, min_pages=40)
    assert floored.num_pages == 40 and floored.floor_applied


def test_min_pool_pages_fits_the_longest_request_past_the_watermark():
    pages = bench.min_pool_pages(1000, 40, 16)  # 65 pages of prompt + output
    assert pages == math.ceil(1.25 * 65 / 0.9)
    assert pages * 0.9 >= 65


def test_percentile_interpolates():
    assert bench.percentile([], 50) is None
    assert bench.percentile([3.0], 90) == 3.0
    assert bench.percentile([4, 1, 3, 2], 50) == 2.5
    assert bench.percentile(list(range(11)), 90) == pytest.approx(9.0)


def test_comparison_ratios_against_lru():
    arms = {
        "lru": {"recomputed_tokens": 1000, "prefill_tokens": 2000, "jct_p50_s": 10.0, "jct_p90_s": 20.0,
                "ttft_returning_p50_s": 0.5},
        "retention": {"recomputed_tokens": 400, "prefill_tokens": 1500, "jct_p50_s": 8.0, "jct_p90_s": 10.0,
                      "ttft_returning_p50_s": 0.25},
        "pause_free": {"turns_per_s": 4.0},
        "pause_free_tier": {"turns_per_s": 3.9},
    }
    out = bench.comparison(arms)
    assert out["recompute_ratio_retention"] == pytest.approx(0.4)
    assert out["prefill_ratio_retention"] == pytest.approx(0.75)
    assert out["jct_p50_ratio_retention"] == pytest.approx(0.8)
    assert out["jct_p90_ratio_retention"] == pytest.approx(0.5)
    assert out["ttft_returning_p50_ratio_retention"] == pytest.approx(0.5)
    assert out["recompute_ratio_retention_tier"] is None  # the arm did not run
    assert out["jct_p50_ratio_retention_tier"] is None
    assert out["throughput_ratio_pause_free_tier"] == pytest.approx(0.975)
    assert bench.comparison({"retention": arms["retention"]})["recompute_ratio_retention"] is None
    assert bench.ratio(1.0, 0) is None


def test_streamed_reply_reassembles_a_tool_call_and_its_first_token_time():
    reply = bench.StreamedReply()
    reply.add({"choices": [{"delta": {"role": "assistant", "content": ""}}]}, 0.1)
    assert reply.first_token_s is None  # the role-only opening is no token
    reply.add({"choices": [{"delta": {"tool_calls": [{"index": 0, "id": "call_1", "type":
               "function", "function": {"name": "get_invoice", "arguments": ""}}]}}]}, 0.5)
    reply.add({"choices": [{"delta": {"tool_calls": [{"index": 0, "function": {
               "arguments": '{"invoice_id": '}}]}}]}, 0.6)
    reply.add({"choices": [{"delta": {"tool_calls": [{"index": 0, "function": {
               "arguments": '"inv_1"}'}}]}, "finish_reason": "tool_calls"}]}, 0.7)
    reply.add({"choices": [], "usage": {"prompt_tokens": 10}}, 0.7)
    assert reply.first_token_s == 0.5 and reply.finish_reason == "tool_calls"
    assert reply.tool_calls() == [{"id": "call_1", "type": "function", "function": {
        "name": "get_invoice", "arguments": '{"invoice_id": "inv_1"}'}}]
    assert reply.usage == {"prompt_tokens": 10}


def test_summary_figures_from_turn_records():
    turns = [bench.Turn(0, 1, 0.0, 0.2, 1.0, 100, 0, 10, "tool_calls"),
             bench.Turn(0, 2, 3.0, 0.1, 3.5, 150, 96, 10, "tool_calls"),
             bench.Turn(1, 1, 0.5, 0.3, 1.5, 100, 96, 10, "length"),
             bench.Turn(1, 2, 4.0, 0.4, 6.5, 150, 0, 10, "tool_calls")]
    row = bench.summarise(turns, 6.5)
    assert row["prefill_tokens"] == 500 - 192
    assert row["prefill_tokens_returning"] == 300 - 96
    assert row["jct_p50_s"] == pytest.approx((3.5 + 6.0) / 2)
    assert row["ttft_returning_p50_s"] == pytest.approx(0.25)
    assert row["cut_calls"] == 1 and row["finish_tool_calls"] == 3
    assert row["final_conversation_tokens"] == [160, 160]


def test_prefill_floor_counts_only_what_no_cache_could_serve():
    shared = 40  # 2 full pages of 16 + 8 tokens
    turns = [bench.Turn(0, 1, 0.0, prompt_tokens=50),  # the first request: all of it
             bench.Turn(1, 1, 0.5, prompt_tokens=52),  # the shared 32 tokens are servable
             bench.Turn(0, 2, 3.0, prompt_tokens=120),  # 48 of the previous 50 are servable
             bench.Turn(1, 2, 4.0, prompt_tokens=33)]  # capped one token short: 32 of 33
    assert bench.prefill_floor(turns, shared, 16) == 50 + (52 - 32) + (120 - 48) + (33 - 32)
    row = bench.summarise([replace_cached(t, 0) for t in turns], 5.0, shared, 16)
    assert row["recomputed_tokens"] == row["prefill_tokens"] - row["prefill_floor_tokens"]


def replace_cached(turn, cached):
    turn.cached_tokens = cached
    return turn
