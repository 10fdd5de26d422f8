"""Shared helpers for benchmarks: --json handling, medians, a plain table printer, ratios, free
ports, and the bounded tool schemas the swarm benchmarks send."""

from __future__ import annotations

import argparse
import json
import platform
import socket
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any


def base_parser(description: str) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--json", type=Path, default=None, help="write results to this JSON file")
    return parser


def median_time(fn: Callable[[], object], repeats: int = 7, warmup: int = 1) -> float:
    """Median wall time of ``fn()`` in seconds (machines here are noisy: medians, not means)."""
    for _ in range(warmup):
        fn()
    samples = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        samples.append(time.perf_counter() - t0)
    return statistics.median(samples)


def print_table(title: str, rows: list[tuple[str, Any]]) -> None:
    width = max(len(k) for k, _ in rows)
    print(f"\n{title}\n" + "-" * (width + 20))
    for key, value in rows:
        shown = f"{value:.4g}" if isinstance(value, float) else str(value)
        print(f"{key:<{width}}  {shown}")


def write_json(path: Path | None, results: dict[str, Any]) -> None:
    if path is None:
        return
    results = {"machine": platform.machine(), "python": platform.python_version(), **results}
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(results, indent=2, sort_keys=True))
    print(f"\nwrote {path}")


def ratio(numerator: float | None, denominator: float | None) -> float | None:
    """numerator / denominator, None when either is unknown or the denominator is 0."""
    if numerator is None or denominator is None or denominator == 0:
        return None
    return numerator / denominator


def free_port() -> int:
    """A TCP port free on 127.0.0.1 right now."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def bounded_schema(node: Any) -> Any:
    """A JSON schema whose every value has a small bounded size: unbounded, a greedy 135M
    model runs on inside a string until max_tokens cuts the call. NOTE: xgrammar ignores
    maxLength next to a ``format``, so the format goes."""
    if isinstance(node, list):
        return [bounded_schema(item) for item in node]
    if not isinstance(node, dict):
        return node
    node = {key: bounded_schema(value) for key, value in node.items()}
    kind = node.get("type")
    if kind == "string" and not {"enum", "pattern"} & node.keys():
        node.pop("format", None)
        node["maxLength"] = min(node.get("maxLength", 12), 12)
    elif kind in ("integer", "number"):
        node["maximum"] = min(node.get("maximum", 1000), 1000)
    elif kind == "array":
        node["maxItems"] = min(node.get("maxItems", 2), 2)
    elif kind == "object" and isinstance(node.get("additionalProperties"), dict):
        node["maxProperties"] = min(node.get("maxProperties", 2), 2)
    return node
