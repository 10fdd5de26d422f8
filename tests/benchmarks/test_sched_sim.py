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
    units_only = sched_sim.run_long(arm, random.Random(0), kv_read_s=0.0)
    with_reads = sched_sim.run_long(arm, random.Random(0))
    big_chunks = sched_sim.run_long(sched_sim.arm_settings("d64s192m2048"), random.Random(0))
    assert with_reads["long_ttft_s"] > units_only["long_ttft_s"]
    assert with_reads["long_ttft_s"] > big_chunks["long_ttft_s"]
