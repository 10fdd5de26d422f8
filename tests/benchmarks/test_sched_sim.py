"""benchmarks.sched_sim: the real Scheduler and KVCacheManager on a virtual clock."""

import random

import pytest

from benchmarks import sched_sim


def test_arm_names_parse_into_scheduler_settings():
    assert sched_sim.arm_settings("d32s128m1024") == dict(
        max_num_batched_tokens=1024, decode_step_budget=32, short_prefill_budget=128)
    assert sched_sim.arm_settings("d16s192")["max_num_batched_tokens"] == 512
    assert sched_sim.arm_settings("default") is sched_sim.ARMS["default"]
    with pytest.raises(SystemExit, match="unknown arm"):
        sched_sim.arm_settings("fast")


def test_a_smaller_decode_budget_bounds_the_bursts_inter_token_latency():
    rng = random.Random(0)
    wide = sched_sim.run_burst(sched_sim.arm_settings("d64s192"), rng)
    narrow = sched_sim.run_burst(sched_sim.arm_settings("d32s192"), random.Random(0))
    assert 1 < narrow["itl_ratio"] < wide["itl_ratio"]
    assert wide["long_ttft_s"] > 0 and narrow["long_ttft_s"] > 0


def test_the_kv_reread_term_charges_small_chunks_of_a_long_prompt():
    arm = sched_sim.arm_settings("d64s192m512")
    units_only = sched_sim.run_long(arm, random.Random(0), sched_sim.Costs(kv_read_s=0.0))
    with_reads = sched_sim.run_long(arm, random.Random(0))
    big_chunks = sched_sim.run_long(sched_sim.arm_settings("d64s192m2048"), random.Random(0))
    assert with_reads["long_ttft_s"] > units_only["long_ttft_s"]
    assert with_reads["long_ttft_s"] > big_chunks["long_ttft_s"]


def test_the_concave_cost_model_makes_big_steps_cheaper_per_row():
    sim = sched_sim.Sim(sched_sim.Scheduler(sched_sim.KVCacheManager(64, 16)),
                        sched_sim.Costs(model="concave"))

    class Chunk:
        def __init__(self, n):
            self.num_tokens = n

    one, sixteen, big = (sim.step_seconds([Chunk(n)], n) for n in (1, 16, 512))
    assert one == 0.012 and sixteen / 16 > big / 512  # per row: a decode step > a prefill step
    assert sim.step_seconds([Chunk(64)], 64 + 10) - sim.step_seconds([Chunk(64)], 64) > 0
