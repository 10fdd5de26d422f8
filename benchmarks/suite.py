"""The workload suite: every scheduling or memory default is judged on all of it together, in one
run, with ratios to vLLM where it applies (issue #25, section 2). Each part is its own
benchmark, run as a subprocess with --json; the suite prints its output, then one table of
headline figures with the issue's targets.

Parts (--parts, all by default; --quick gives each its small preset):
  * ``swarm``: benchmarks.serving, the agent swarm (decode-heavy, one shared prefix), default
    workload {--agents 4 --turns 2 --prompt-tokens 1000}; vs the peer.
  * ``trace``: benchmarks.trace on the public Mooncake trace (../shared/traces/), its defaults:
    48 sessions, closed loop, a working set ~2x the 1 GiB pool {--quick}; vs the peer.
  * ``agent_trace``: benchmarks.agent_trace's sessions {--agents 4 --turns 3}, replayed by
    benchmarks.trace at --scale 16 --time-scale 0.5, every session and turn {--max-output
    32}; vs the peer.
  * ``sessions``: benchmarks.agent_sessions, tool-pause sessions, arms --sessions-arms
    [lru,retention] (retention = the server's defaults; LRU = --retention 0) {--quick};
    prefixgate only (ratios to LRU).
  * ``burst``: benchmarks.burst, long prompts (~6-7k tokens: Claude Code's 12-16k scaled to the
    default model's 8,192 context) arriving while 16 streams decode {--quick}; vs the peer.
--prefixgate-args go to every prefixgate server of every part (agent_sessions: to its
retention arms, its LRU arm keeps --retention 0 only), so one setting is judged everywhere.

    python -m benchmarks.suite --peer vllm --json out/suite.json
    python -m benchmarks.suite --quick --peer vllm
    python -m benchmarks.suite --parts trace,burst --prefixgate-args "--max-num-batched-tokens 2048"
"""

from __future__ import annotations

import json
import os
import shlex
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from benchmarks.common import base_parser, write_json
from benchmarks.serving import DEFAULT_PEERS_DIR, PEERS
from benchmarks.trace import shown

PARTS = ("swarm", "trace", "agent_trace", "sessions", "burst")
AGENT_TRACE_REPLAY = ["--scale", "16", "--time-scale", "0.5", "--sessions", "999",
                      "--min-turns", "1", "--max-turns", "99"]


def part_commands(part: str, quick: bool, folder: Path, peer: list[str], pg_args: str,
                  sessions_arms: str) -> list[list[str]]:
    """The commands one part runs (the last one writes ``folder / part.json``)."""
    out = ["--json", str(folder / f"{part}.json")]
    pg = ["--prefixgate-args", pg_args] if pg_args else []
    if part == "swarm":
        small = ["--agents", "4", "--turns", "2", "--prompt-tokens", "1000"] if quick else []
        return [["benchmarks.serving", *small, *peer, *pg, *out]]
    if part == "trace":
        return [["benchmarks.trace", *(["--quick"] if quick else []), *peer, *pg, *out]]
    if part == "agent_trace":
        trace = str(folder / "agent_trace.jsonl")
        small = ["--agents", "4", "--turns", "3"] if quick else []
        return [["benchmarks.agent_trace", "--out", trace, *small],
                ["benchmarks.trace", "--trace", trace, *AGENT_TRACE_REPLAY,
                 *(["--max-output", "32"] if quick else []), *peer, *pg, *out]]
    if part == "sessions":
        return [["benchmarks.agent_sessions", *(["--quick"] if quick else []), "--arms",
                 sessions_arms, "--pause-free-repeats", "0",
                 *(["--retention-args", pg_args] if pg_args else []), *out]]
    if part == "burst":
        return [["benchmarks.burst", *(["--quick"] if quick else []), *peer, *pg, *out]]
    raise ValueError(f"unknown part {part!r} (choose from {', '.join(PARTS)})")


def _trace_rows(data: dict[str, Any]) -> list[tuple]:
    ours, theirs = _servers(data)
    rows = [("wall (s); closed-loop floor " + shown(data["workload"]["floor_s"]), "wall_s", None)]
    rows += [("request E2E p50 (s)", "e2e_p50_s", 0.6), ("request E2E sum (s)", "e2e_sum_s", 0.6),
             ("TTFT p50 (s)", "ttft_p50_s", 0.5), ("returning-turn TTFT p90 (s)",
                                                   "ttft_returning_p90_s", 0.5),
             ("ITL p90 (s)", "itl_p90_s", None), ("session completion p50 (s)",
                                                   "session_p50_s", None),
             ("prefill tokens computed", "prefill_tokens", 0.7), ("hit rate", "hit_rate", None)]
    return [(label, ours.get(key), theirs.get(key), target) for label, key, target in rows]


def _servers(data: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    servers = data.get("servers", {})
    ours = servers.get("prefixgate", {})
    theirs = next((s for name, s in servers.items() if name != "prefixgate"), {})
    return ours, theirs


def _swarm_rows(data: dict[str, Any]) -> list[tuple]:
    ours, theirs = _servers(data)
    return [(label, ours.get(key), theirs.get(key), "today's")
            for label, key in (("wall (s)", "wall_s"), ("TTFT p50 (s)", "ttft_p50_s"),
                               ("TTFT p90 (s)", "ttft_p90_s"),
                               ("output tokens/s", "output_tokens_per_s"))]


def _sessions_rows(data: dict[str, Any]) -> list[tuple]:
    arms = data.get("arms", {})
    retention, lru = arms.get("retention", {}), arms.get("lru", {})
    return [(f"{label} (defaults | LRU)", retention.get(key), lru.get(key), None)
            for label, key in (("JCT p50 (s)", "jct_p50_s"), ("JCT p90 (s)", "jct_p90_s"),
                               ("prefill tokens", "prefill_tokens"),
                               ("returning TTFT p90 (s)", "ttft_returning_p90_s"),
                               ("wall (s)", "wall_s"))]


def _burst_rows(data: dict[str, Any]) -> list[tuple]:
    ours, theirs = _servers(data)
    rows = [(label, ours.get(key), theirs.get(key), None)
            for label, key in (("stream ITL p90, no burst (s)", "itl_before_p90_s"),
                               ("stream ITL p90, burst (s)", "itl_burst_p90_s"),
                               ("burst TTFT p50 (s)", "burst_ttft_p50_s"),
                               ("burst TTFT max (s)", "burst_ttft_max_s"))]
    rows.append(("ITL p90 burst / no burst (target <= 2)", ours.get("itl_p90_burst_over_before"),
                 theirs.get("itl_p90_burst_over_before"), None))
    return rows


HEADLINES: dict[str, Callable[[dict[str, Any]], list[tuple]]] = {
    "swarm": _swarm_rows, "trace": _trace_rows, "agent_trace": _trace_rows,
    "sessions": _sessions_rows, "burst": _burst_rows}


def print_summary(results: dict[str, Any]) -> None:
    """One table: part, figure, prefixgate, the other column (peer, or LRU), ratio, target."""
    lines = [["part", "figure", "prefixgate", "peer | LRU", "ratio", "ratio target"]]
    for part, data in results["parts"].items():
        if "error" in data:
            lines.append([part, data["error"], "", "", "", ""])
            continue
        for label, ours, theirs, target in HEADLINES[part](data):
            value = (ours / theirs if isinstance(ours, int | float) and isinstance(theirs, int | float)
                     and theirs else None)
            lines.append([part, label, shown(ours), shown(theirs), shown(value),
                          "" if target is None else f"<= {target}" if isinstance(target, float)
                          else target])
    widths = [max(len(line[i]) for line in lines) for i in range(len(lines[0]))]
    print("\nworkload suite (benchmarks.suite)\n" + "-" * (sum(widths) + 2 * len(widths)))
    for line in lines:
        print("  ".join(cell.ljust(w) if i < 2 else cell.rjust(w)
                        for i, (cell, w) in enumerate(zip(line, widths, strict=True))))


def run_part(part: str, commands: list[list[str]], folder: Path) -> dict[str, Any]:
    """Run a part's commands in turn; its JSON, or {"error": ...} when it failed."""
    started = time.perf_counter()
    for command in commands:
        print(f"\n=== {part}: python -m {shlex.join(command)}", flush=True)
        code = subprocess.run([sys.executable, "-m", *command], check=False).returncode
        if code not in (0, 1):  # 1: the run finished but some request failed (in the JSON)
            return {"error": f"exit status {code}"}
    path = folder / f"{part}.json"
    if not path.exists():
        return {"error": "no JSON written"}
    data = json.loads(path.read_text())
    data["part_wall_s"] = time.perf_counter() - started
    return data


def main(argv: list[str] | None = None) -> int:
    parser = base_parser(__doc__.splitlines()[0])
    parser.add_argument("--parts", default=",".join(PARTS),
                        help=f"comma-separated, from {','.join(PARTS)}")
    parser.add_argument("--quick", action="store_true", help="each part's small preset")
    parser.add_argument("--peer", choices=["vllm"], help="the peer of every part that has one")
    parser.add_argument("--peers-dir", type=Path, default=DEFAULT_PEERS_DIR)
    parser.add_argument("--prefixgate-args", default="",
                        help="extra `prefixgate serve` flags for every part")
    parser.add_argument("--sessions-arms", default="lru,retention",
                        help="benchmarks.agent_sessions arms [lru,retention]")
    args = parser.parse_args(argv)
    parts = [p.strip() for p in args.parts.split(",") if p.strip()]
    unknown = [p for p in parts if p not in PARTS]
    if unknown or not parts:
        parser.error(f"unknown part(s) {', '.join(unknown) or '(none given)'}; choose from "
                     f"{', '.join(PARTS)}")
    if args.peer and not (args.peers_dir / PEERS[args.peer][0] / "serve.sh").exists():
        print(f"peer {args.peer!r} is not installed under {args.peers_dir}", file=sys.stderr)
        return 2
    peer = ["--peer", args.peer, "--peers-dir", str(args.peers_dir)] if args.peer else []
    results: dict[str, Any] = {"quick": args.quick, "peer": args.peer,
                               "prefixgate_args": args.prefixgate_args, "parts": {},
                               "loadavg_1min_start": os.getloadavg()[0]}
    with tempfile.TemporaryDirectory(prefix="suite_") as tmp:
        for part in parts:
            commands = part_commands(part, args.quick, Path(tmp), peer, args.prefixgate_args,
                                     args.sessions_arms)
            results["parts"][part] = run_part(part, commands, Path(tmp))
    results["loadavg_1min_end"] = os.getloadavg()[0]
    print_summary(results)
    write_json(args.json, results)
    return 0 if all("error" not in data for data in results["parts"].values()) else 1


if __name__ == "__main__":
    sys.exit(main())
