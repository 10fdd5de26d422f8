"""Report statistics: percentiles, summaries of hand-built records, comparison, table, JSON."""

from __future__ import annotations

import json
import random

import numpy as np
import pytest
from rich.console import Console

from prefixgate.agents.report import Percentiles, compare, percentile, summarize, table, write_json
from prefixgate.agents.runner import RequestRecord, RunResult


def test_percentile_matches_numpy_linear():
    rng = random.Random(0)
    for size in (1, 2, 3, 10, 101):
        values = [rng.uniform(0, 10) for _ in range(size)]
        for q in (0, 50, 90, 99, 100):
            assert percentile(values, q) == pytest.approx(np.percentile(values, q))
    assert percentile([4.0, 1.0, 3.0, 2.0], 50) == 2.5
    assert percentile([], 50) is None
    with pytest.raises(ValueError, match="percentile"):
        percentile([1.0], 101)


def record(index: int, **fields) -> RequestRecord:
    return RequestRecord(agent_id=f"g0-a{index}", group=0, turn=0, send_index=index,
                         start_s=0.0, **fields)


def test_summary_of_hand_built_records():
    records = [
        record(0, ttft_s=0.1, e2e_s=0.5, prompt_tokens=100, completion_tokens=5, cached_tokens=0,
               tokenized_len=100, ideal_tokens=0, ideal_block_tokens=0),
        record(1, ttft_s=0.2, e2e_s=1.0, prompt_tokens=100, completion_tokens=9,
               cached_tokens=64, tokenized_len=100, ideal_tokens=90, ideal_block_tokens=80),
        record(2, ttft_s=0.3, e2e_s=0.3, prompt_tokens=100, completion_tokens=1,
               cached_tokens=32, tokenized_len=100, ideal_tokens=60, ideal_block_tokens=48),
        record(3, error_kind="http_500", error="boom", status=500, tokenized_len=100,
               ideal_tokens=99, ideal_block_tokens=96),
        record(4, error_kind="bad_sse", error="x", e2e_s=0.01),
        record(5, error_kind="bad_sse", error="y", e2e_s=0.01),
    ]
    summary = summarize([RunResult("A", "http://a", 2.0, records, "ok")])
    assert (summary.requests, summary.ok) == (6, 3)
    assert summary.errors == {"http_500": 1, "bad_sse": 2}
    assert summary.ttft_s == Percentiles(0.2, pytest.approx(0.28), pytest.approx(0.298))
    # TPOT over requests with more than one output token: 0.4/4 and 0.8/8.
    assert summary.tpot_s.p50 == pytest.approx(0.1)
    assert summary.output_tokens == 15
    assert summary.output_tokens_per_s == pytest.approx(7.5)
    assert summary.achieved_hit_rate == pytest.approx(96 / 300)
    assert summary.ideal_hit_rate == pytest.approx(150 / 300)  # failed requests excluded
    assert summary.ideal_block_hit_rate == pytest.approx(128 / 300)
    assert summary.achieved_over_ideal == pytest.approx(96 / 128)


def test_summary_without_cached_tokens_or_tokenize():
    records = [record(0, ttft_s=0.1, e2e_s=0.2, prompt_tokens=10, completion_tokens=2)]
    summary = summarize([RunResult("B", "http://b", 1.0, records, "POST /tokenize -> 404")])
    assert summary.achieved_hit_rate is None
    assert summary.ideal_hit_rate is None and summary.achieved_over_ideal is None
    text = render(table([summary], 16))
    assert "not reported" in text and "unknown" in text


def render(grid) -> str:
    console = Console(record=True, width=200)
    console.print(grid)
    return console.export_text()


def test_compare_and_table_and_json(tmp_path):
    fast = [record(0, ttft_s=0.1, e2e_s=1.0, prompt_tokens=10, completion_tokens=11)]
    slow = [record(0, ttft_s=0.3, e2e_s=2.0, prompt_tokens=10, completion_tokens=11)]
    runs = [RunResult("A", "http://a", 1.0, fast, "ok"), RunResult("B", "http://b", 4.0, slow,
                                                                   "ok")]
    a, b = summarize(runs[:1]), summarize(runs[1:])
    assert compare(a, b) == {"ttft_p50": pytest.approx(3.0),
                             "output_tokens_per_s": pytest.approx(4.0),
                             "e2e_p50": pytest.approx(2.0)}
    assert "A advantage" in render(table([a, b], 16))
    path = tmp_path / "out" / "swarm.json"
    write_json(path, {"seed": 1}, runs, [a, b])
    document = json.loads(path.read_text())
    assert document["config"] == {"seed": 1}
    assert document["runs"][1]["records"][0]["ttft_s"] == 0.3
    assert document["summaries"][0]["ttft_s"] == {"p50": 0.1, "p90": 0.1, "p99": 0.1}
    assert document["comparison"]["ttft_p50"] == pytest.approx(3.0)
