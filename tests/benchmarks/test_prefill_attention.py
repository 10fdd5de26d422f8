"""benchmarks.prefill_attention on tiny shapes: both paths run, the FLOP count is the causal
one, and the figures are consistent with each other. Timings themselves never gate."""

import pytest

from benchmarks import prefill_attention as bench
from prefixgate.kernels.cpu.library import library


def test_flops_count_each_visible_query_key_pair():
    # 2 new rows over a 5-token context see 4 and 5 keys; 4 x D per pair and query head
    assert bench._flops(2, 5, hq=3, d=16) == 4 * 16 * 3 * (4 + 5)


@pytest.mark.skipif(library() is None, reason="native CPU library not built here")
def test_rows_report_both_paths():
    rows = bench.measure(((3, 40), (20, 20)), heads=(4, 2, 16), repeats=1)
    assert [(r["rows"], r["context"]) for r in rows] == [(3, 40), (20, 20)]
    for r in rows:
        assert r["native_ms"] > 0 and r["torch_ms"] > 0
        assert r["speedup"] == pytest.approx(r["torch_ms"] / r["native_ms"], rel=0.02)
        assert r["native_gflops"] == pytest.approx(r["flops"] / r["native_ms"] / 1e6, rel=0.02, abs=0.06)
