"""benchmarks.step_overhead: a tiny real run on the default model (2 requests, a few tokens):
the JSON's keys, and figures that are consistent with each other (a step's phases add up to
it, the forward is part of the step). Timings themselves never gate."""

import json

import pytest

from benchmarks import step_overhead as bench
from benchmarks.common import write_json

TINY = bench.Settings(batch=2, prompt_tokens=40, shared_tokens=24, max_tokens=6, repeats=1,
                      speculative_tokens=2, speculative_batch=2)


@pytest.fixture(scope="module")
def results(loaded_model):
    return bench.run_benchmark(TINY, loaded_model, log=lambda _: None)


def test_prompts_have_the_asked_sizes_and_share_their_prefix(tokenizer):
    prompts = bench.build_prompts(tokenizer, TINY)
    assert len(prompts) == 2 and all(len(p) == 40 for p in prompts)
    assert prompts[0][:24] == prompts[1][:24] and prompts[0][24:] != prompts[1][24:]
    assert bench.build_prompts(tokenizer, TINY) == prompts  # seeded


def test_json_has_every_run_and_the_workload(results, tmp_path):
    assert {"greedy_lean", "greedy", "sampled", "async", "speculative"} <= set(results)
    assert results["settings"]["batch"] == 2
    assert len(results["load_avg_before"]) == 3 and results["cpu_threads"] >= 1
    assert results["greedy_identical"] is True  # lean, instrumented and async: same tokens
    write_json(tmp_path / "out.json", results)
    assert json.loads((tmp_path / "out.json").read_text())["greedy_digest"] == results["greedy_digest"]
    assert bench.table_rows(results)


def test_the_lean_run_times_only_step_and_forward(results):
    lean = results["greedy_lean"]
    assert lean["steps"] >= 1 and "phases_ms" not in lean
    assert 0 < lean["forward_ms"] <= lean["step_ms"]


@pytest.mark.parametrize("name", ["greedy", "sampled", "async", "speculative"])
def test_phases_add_up_to_the_step(results, name):
    run = results[name]
    assert run["tokens_per_s"] > 0
    if name != "async":  # the async front may admit its requests over two steps
        assert run["steps"] >= 1
    if not run["steps"]:
        return
    phases, means = run["phases_ms"], run["phases_mean_ms"]
    assert {"schedule", "inputs", "forward", "sample", "detokenize", "emit", "other"} <= set(phases)
    # exclusive times: every step's phases sum to it exactly, so their means do too
    assert sum(means.values()) == pytest.approx(run["step_mean_ms"], rel=1e-6)
    assert all(-1e-6 <= ms <= run["step_ms"] + 1e-6 for ms in phases.values())
    assert phases["forward"] == run["forward_ms"] <= run["step_ms"]
    assert run["overhead_ms"] >= 0 and 0 <= run["overhead_pct"] <= 100
    if name == "async":
        assert "sink" in phases or "sink" in run.get("between_steps_ms", {})
        assert run["loop_cpu_ms_per_step"] >= 0
    if name == "speculative":
        assert "drafts" in phases and run["drafts"] >= 0
