"""Statistics of swarm runs: percentiles, throughput, hit rates, comparisons; rich table + JSON."""

from __future__ import annotations

import json
import math
from collections import Counter
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import NamedTuple

from rich.table import Table

from prefixgate.agents.runner import RequestRecord, RunResult


def percentile(values: Sequence[float], q: float) -> float | None:
    """The ``q``-th percentile (0..100) with linear interpolation between ranks; None if empty."""
    if not 0 <= q <= 100:
        raise ValueError(f"percentile q must be in [0, 100], got {q}")
    if not values:
        return None
    ordered = sorted(values)
    rank = (len(ordered) - 1) * q / 100
    low, high = math.floor(rank), math.ceil(rank)
    return ordered[low] + (ordered[high] - ordered[low]) * (rank - low)


class Percentiles(NamedTuple):
    p50: float | None
    p90: float | None
    p99: float | None

    @classmethod
    def of(cls, values: Sequence[float]) -> Percentiles:
        return cls(percentile(values, 50), percentile(values, 90), percentile(values, 99))


def _ratio(numerator: float, denominator: float) -> float | None:
    return numerator / denominator if denominator else None


@dataclass(frozen=True, slots=True)
class Summary:
    """One endpoint's figures over one or more runs (hit rates are fractions of prompt tokens)."""

    label: str
    url: str
    requests: int
    ok: int
    errors: dict[str, int]  # error kind -> count
    wall_s: float
    ttft_s: Percentiles
    tpot_s: Percentiles  # (e2e - ttft) / (output tokens - 1)
    e2e_s: Percentiles
    prompt_tokens: int
    output_tokens: int
    output_tokens_per_s: float | None
    achieved_hit_rate: float | None  # None: the server reports no cached_tokens
    ideal_hit_rate: float | None  # token level; None: /tokenize unavailable ("unknown")
    ideal_block_hit_rate: float | None  # rounded down to whole pages
    achieved_over_ideal: float | None  # achieved / block-level ideal, same requests
    tokenize: str

    def to_dict(self) -> dict:
        document = asdict(self)
        for name in ("ttft_s", "tpot_s", "e2e_s"):
            document[name] = getattr(self, name)._asdict()
        return document


def _output_tokens(record: RequestRecord) -> int:
    return record.completion_tokens if record.completion_tokens is not None \
        else record.output_chunks


def summarize(runs: Sequence[RunResult]) -> Summary:
    """Pool the records of ``runs`` (same endpoint) into one ``Summary``."""
    if not runs:
        raise ValueError("summarize needs at least one run")
    records = [record for run in runs for record in run.records]
    good = [r for r in records if r.ok]
    wall_s = sum(run.wall_s for run in runs)
    output_tokens = sum(_output_tokens(r) for r in good)
    tpot = [(r.e2e_s - r.ttft_s) / (_output_tokens(r) - 1) for r in good
            if r.ttft_s is not None and r.e2e_s is not None and _output_tokens(r) > 1]

    cached = [r for r in good if r.cached_tokens is not None and r.prompt_tokens]
    ideal = [r for r in good if r.ideal_tokens is not None and r.tokenized_len]
    both = [r for r in cached if r.ideal_block_tokens is not None]
    achieved = _ratio(sum(r.cached_tokens for r in cached), sum(r.prompt_tokens for r in cached))
    ideal_rate = _ratio(sum(r.ideal_tokens for r in ideal), sum(r.tokenized_len for r in ideal))
    ideal_blocks = _ratio(sum(r.ideal_block_tokens for r in ideal),
                          sum(r.tokenized_len for r in ideal))
    over = _ratio(sum(r.cached_tokens for r in both), sum(r.ideal_block_tokens for r in both))
    statuses = sorted({run.tokenize for run in runs})
    return Summary(
        label=runs[0].label, url=runs[0].url, requests=len(records), ok=len(good),
        errors=dict(Counter(r.error_kind for r in records if not r.ok)), wall_s=wall_s,
        ttft_s=Percentiles.of([r.ttft_s for r in good if r.ttft_s is not None]),
        tpot_s=Percentiles.of(tpot),
        e2e_s=Percentiles.of([r.e2e_s for r in good if r.e2e_s is not None]),
        prompt_tokens=sum(r.prompt_tokens or 0 for r in good), output_tokens=output_tokens,
        output_tokens_per_s=_ratio(output_tokens, wall_s),
        achieved_hit_rate=achieved, ideal_hit_rate=ideal_rate, ideal_block_hit_rate=ideal_blocks,
        achieved_over_ideal=over if both else None, tokenize="; ".join(statuses))


def compare(a: Summary, b: Summary) -> dict[str, float | None]:
    """How many times better ``a`` is than ``b`` (> 1: a wins) on TTFT p50, throughput, e2e p50."""

    def times(better: float | None, worse: float | None) -> float | None:
        return worse / better if better and worse is not None else None

    return {"ttft_p50": times(a.ttft_s.p50, b.ttft_s.p50),
            "output_tokens_per_s": times(b.output_tokens_per_s, a.output_tokens_per_s),
            "e2e_p50": times(a.e2e_s.p50, b.e2e_s.p50)}


def _ms(values: Percentiles) -> str:
    return " / ".join("-" if v is None else f"{v * 1000:.0f}" for v in values)


def _pct(value: float | None, unknown: str = "n/a") -> str:
    return unknown if value is None else f"{value:.1%}"


def table(summaries: Sequence[Summary], page_size: int) -> Table:
    """A rich table with one column per endpoint, plus A-vs-B ratios when there are two."""
    grid = Table(title="prefixgate swarm", show_lines=False)
    grid.add_column("metric", style="bold")
    for s in summaries:
        grid.add_column(f"{s.label}: {s.url}", justify="right")
    ratios = compare(summaries[0], summaries[1]) if len(summaries) == 2 else None
    if ratios is not None:
        grid.add_column(f"{summaries[0].label} advantage ×", justify="right")

    def row(name: str, cells: list[str], ratio: float | None | str = "") -> None:
        extra = [] if ratios is None else ["-" if ratio is None else
                                           ratio if isinstance(ratio, str) else f"{ratio:.2f}"]
        grid.add_row(name, *cells, *extra)

    row("requests ok / sent", [f"{s.ok} / {s.requests}" for s in summaries])
    row("errors", [", ".join(f"{k}: {n}" for k, n in sorted(s.errors.items())) or "0"
                   for s in summaries])
    row("TTFT p50/p90/p99 ms", [_ms(s.ttft_s) for s in summaries],
        ratios and ratios["ttft_p50"])
    row("TPOT p50/p90/p99 ms", [_ms(s.tpot_s) for s in summaries])
    row("E2E p50/p90/p99 ms", [_ms(s.e2e_s) for s in summaries], ratios and ratios["e2e_p50"])
    row("output tokens/s", ["-" if s.output_tokens_per_s is None else
                            f"{s.output_tokens_per_s:.1f}" for s in summaries],
        ratios and ratios["output_tokens_per_s"])
    row("prompt / output tokens", [f"{s.prompt_tokens} / {s.output_tokens}" for s in summaries])
    row("hit rate achieved", [_pct(s.achieved_hit_rate, "not reported") for s in summaries])
    row("hit rate ideal: tokens", [_pct(s.ideal_hit_rate, "unknown") for s in summaries])
    row(f"hit rate ideal: {page_size}-token blocks",
        [_pct(s.ideal_block_hit_rate, "unknown") for s in summaries])
    row("achieved / ideal (blocks)", [_pct(s.achieved_over_ideal) for s in summaries])
    row("wall s", [f"{s.wall_s:.2f}" for s in summaries])
    return grid


def write_json(path: str | Path, config: dict, runs: Sequence[RunResult],
               summaries: Sequence[Summary]) -> None:
    """Config, every run's per-request records, the summaries and (for two) the comparison."""
    document = {
        "config": config,
        "runs": [{"label": run.label, "url": run.url, "model": run.model, "wall_s": run.wall_s,
                  "tokenize": run.tokenize, "records": [r.to_dict() for r in run.records]}
                 for run in runs],
        "summaries": [s.to_dict() for s in summaries],
        "comparison": compare(summaries[0], summaries[1]) if len(summaries) == 2 else None,
    }
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(document, indent=2))
