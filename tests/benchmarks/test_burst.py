"""benchmarks.burst: the workload, the before/during split of the streams' gaps, and a tiny burst
against the live test gateway."""

import asyncio

import pytest

from benchmarks import burst as bench


def test_workload_sizes_and_presets():
    assert bench.BurstWorkload().burst_sizes() == [6000, 6333, 6667, 7000]
    assert bench.BurstWorkload(burst=1).burst_sizes() == [7000]
    with pytest.raises(ValueError, match="burst_min_tokens <= burst_max_tokens"):
        bench.BurstWorkload(burst_min_tokens=8000)
    with pytest.raises(ValueError, match="exceed settle_tokens"):
        bench.BurstWorkload(stream_max_tokens=4, settle_tokens=12)
    parser = bench.base_parser("t")
    bench.add_workload_arguments(parser)
    quick = bench.workload_from_args(parser.parse_args(["--quick", "--streams", "5"]))
    assert quick.streams == 5 and quick.burst == bench.QUICK["burst"]


def test_prompts_share_nothing():
    first, second = bench.distinct_prompt(0, 300), bench.distinct_prompt(1, 300)
    assert len(first) == 300 and first == bench.distinct_prompt(0, 300)
    assert all(a != b for a, b in zip(first[::16], second[::16], strict=True))


def test_gaps_overlapping_the_burst_count_as_the_burst():
    # chunks at 0, 1, 2, 3 | burst sent at 3.5 | 10 (one stall over the whole burst), 11
    stream = bench.Stream(chunks=[0.0, 1.0, 2.0, 3.0, 10.0, 11.0], sent=-1.0)
    burst = [bench.Stream(chunks=[9.0], sent=3.5), bench.Stream(sent=3.5, error="HTTP 400: x")]
    figures = bench.burst_figures([stream], burst, sent=3.5, done=9.5)
    assert figures["itl_samples_before"] == 2  # 1->2, 2->3: the first gap is left out
    assert figures["itl_burst_max_s"] == 7.0 and figures["itl_samples_burst"] == 1
    assert figures["itl_p90_burst_over_before"] == pytest.approx(7.0)
    assert figures["burst_ttft_p50_s"] == 5.5 and figures["burst_ok"] == 1
    assert figures["errors"] == 1 and figures["first_error"] == "HTTP 400: x"


def test_the_no_burst_baseline_starts_once_every_stream_decodes():
    # a late stream's first token at 2.5: the early stream's gaps before it are its neighbour's
    # admission, not steady decoding
    early = bench.Stream(chunks=[0.0, 1.0, 2.0, 2.2, 2.4, 2.6, 3.0], sent=-1.0)
    late = bench.Stream(chunks=[2.5, 2.7, 2.9, 3.1], sent=-1.0)
    figures = bench.burst_figures([early, late], [], sent=3.2, done=4.0)
    assert figures["itl_samples_before"] == 3  # 2.6->3.0, 2.7->2.9, 2.9->3.1
    assert figures["itl_before_p50_s"] == pytest.approx(0.2)


def test_a_tiny_burst_against_the_live_gateway(gateway):
    workload = bench.BurstWorkload(streams=2, stream_tokens=32, stream_max_tokens=400,
                                   settle_tokens=4, burst=2, burst_min_tokens=150,
                                   burst_max_tokens=200)
    figures = asyncio.run(bench.run_burst(gateway.open_url, gateway.model, workload, 120))
    assert figures["errors"] == 0 and figures["burst_ok"] == 2
    assert figures["itl_samples_before"] >= 2 * 2 and figures["itl_samples_burst"] >= 2
    assert figures["burst_ttft_max_s"] <= figures["burst_wall_s"]
