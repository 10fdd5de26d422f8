"""``python -m prefixgate.agents.swarm``: drive an agent swarm against OpenAI-compatible servers and report
latency, throughput and prefix-cache hit rates (achieved vs ideal)."""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import functools
import os
import sys
from collections.abc import Sequence

from rich.console import Console
from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    Progress,
    TaskID,
    TextColumn,
    TimeElapsedColumn,
)

from prefixgate.agents.report import summarize, table, write_json
from prefixgate.agents.runner import Endpoint, RequestRecord, RunResult, run_workload
from prefixgate.agents.workload import ARRIVALS, SwarmConfig, build_workload

DESCRIPTION = """\
Run a swarm of agents against an OpenAI-compatible server (POST /v1/chat/completions, streamed).

Workload: GROUPS groups x AGENTS_PER_GROUP agents. Agents of a group share one system prompt
(role instructions, JSON tool schemas, policies: about --system-tokens tokens); each agent has
its own task (--task-tokens) and runs --turns turns. After each turn it appends the assistant's
real reply and then a tool result or a user follow-up (--followup-tokens), so every turn
re-sends a longer prefix. Text is realistic and deterministic from --seed; token counts are
approximate (words + punctuation). Each agent is sent as `user` and header `X-Agent-Id`
(`g<group>-a<index>`), so a server can report per-agent stats.

Per request: TTFT, inter-chunk times, end-to-end time, usage prompt/completion tokens,
usage.prompt_tokens_details.cached_tokens (absent = not reported), and any error (unreachable,
HTTP 4xx/5xx, malformed SSE, hang-up, timeout: counted per request, never fatal).
The table shows p50/p90/p99 of TTFT, TPOT = (e2e - TTFT) / (output tokens - 1) and e2e over
successful requests, output tokens/s over the run's wall time, and the error counts.

Hit rates: achieved = sum(cached_tokens) / sum(prompt_tokens). Ideal = the fraction an infinite
cache could reuse: per request the longest common token prefix with any earlier-sent request
(an agent's previous turn counts with its generated tokens but the last, which never has KV),
at most prompt length - 1, at token level and rounded down to --page-size blocks. Token ids
come from the server's POST /tokenize after the run; without it the ideal is "unknown".
"""

EPILOG = """\
examples:
  python -m prefixgate.agents.swarm --url http://127.0.0.1:8000 --groups 4 --agents-per-group 8 --turns 6
  python -m prefixgate.agents.swarm --arrival poisson --rate 2 --json out/swarm.json
  python -m prefixgate.agents.swarm --url http://127.0.0.1:8000 --compare http://127.0.0.1:8001

--compare runs the identical workload (same seed, same requests) against a second server,
alternating whole runs (A, B, A, B... for --rounds), never concurrently, and prints ratios
"A advantage x" (> 1: A is better) for TTFT p50, output throughput and e2e p50. Round r uses
seed + r so a later round does not replay prompts the server already cached. Replies differ
between servers unless both decode greedily (--temperature 0, the default) with one model.

The ideal counts only the requests of the run itself: a server still warm from an earlier run
with the same --seed can beat it (achieved / ideal > 100%); use a fresh seed or server.

--json PATH writes {config, runs: [{label, url, model, wall_s, tokenize, records: [...]}],
summaries: [...], comparison}. Exit status: 0 when every server answered at least one request.
"""


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    defaults = SwarmConfig()
    parser = argparse.ArgumentParser(prog="python -m prefixgate.agents.swarm", description=DESCRIPTION,
                                     epilog=EPILOG,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    server = parser.add_argument_group("server")
    server.add_argument("--url", default="http://127.0.0.1:8000",
                        help="server root (a trailing /v1 is accepted) (default: %(default)s)")
    server.add_argument("--api-key", default=os.environ.get("PREFIXGATE_API_KEY", "EMPTY"),
                        help="bearer token (default: env PREFIXGATE_API_KEY, else EMPTY)")
    server.add_argument("--model", default=defaults.model,
                        help="model name sent in each request (default: the first id of the "
                             "server's GET /v1/models; omitted if it has none)")
    server.add_argument("--compare", metavar="URL2",
                        help="also run the identical workload against this server")
    server.add_argument("--compare-api-key", help="bearer token for URL2 (default: --api-key)")
    server.add_argument("--compare-model", help="model name for URL2 (default: --model)")
    server.add_argument("--timeout", type=float, default=300.0,
                        help="per-request connect/read timeout, seconds (default: %(default)s)")

    swarm = parser.add_argument_group("workload")
    swarm.add_argument("--groups", type=int, default=defaults.groups,
                       help="groups sharing a system prompt (default: %(default)s)")
    swarm.add_argument("--agents-per-group", type=int, default=defaults.agents_per_group,
                       help="agents per group, each with its own task (default: %(default)s)")
    swarm.add_argument("--turns", type=int, default=defaults.turns,
                       help="requests per agent (default: %(default)s)")
    swarm.add_argument("--system-tokens", type=int, default=defaults.system_tokens,
                       help="shared system prompt incl. tool schemas (default: %(default)s)")
    swarm.add_argument("--task-tokens", type=int, default=defaults.task_tokens,
                       help="each agent's opening task (default: %(default)s)")
    swarm.add_argument("--followup-tokens", type=int, default=defaults.followup_tokens,
                       help="each tool result / user follow-up (default: %(default)s)")
    swarm.add_argument("--max-tokens", type=int, default=defaults.max_tokens,
                       help="max output tokens per request (default: %(default)s)")
    swarm.add_argument("--temperature", type=float, default=defaults.temperature,
                       help="sampling temperature (default: %(default)s)")
    swarm.add_argument("--tools-field", action="store_true",
                       help="send tool schemas in the request's `tools` field instead of "
                            "embedding them in the system prompt text")
    swarm.add_argument("--seed", type=int, default=defaults.seed,
                       help="workload seed (default: %(default)s)")

    load = parser.add_argument_group("load")
    load.add_argument("--concurrency", type=int, default=defaults.concurrency,
                      help="max requests in flight (default: %(default)s)")
    load.add_argument("--arrival", choices=ARRIVALS, default=defaults.arrival,
                      help="burst: all agents at t=0; staggered: agent k at k*--interval; "
                           "poisson: --rate agents/s (default: %(default)s)")
    load.add_argument("--interval", type=float, default=defaults.interval_s,
                      help="staggered arrival interval, seconds (default: %(default)s)")
    load.add_argument("--rate", type=float, default=defaults.rate,
                      help="poisson arrival rate, agents/s (default: %(default)s)")
    load.add_argument("--rounds", type=int, default=1,
                      help="whole runs per server, alternating with --compare "
                           "(default: %(default)s)")

    out = parser.add_argument_group("report")
    out.add_argument("--page-size", type=int, default=16,
                     help="block size for the block-level ideal hit rate (default: %(default)s)")
    out.add_argument("--no-tokenize", action="store_true",
                     help="skip POST /tokenize (ideal hit rate becomes unknown)")
    out.add_argument("--json", metavar="PATH", help="write config, records and summary here")
    out.add_argument("--no-progress", action="store_true", help="no progress bar")
    args = parser.parse_args(argv)
    if args.rounds < 1:
        parser.error("--rounds must be >= 1")
    if args.page_size < 1:
        parser.error("--page-size must be >= 1")
    if args.timeout <= 0:
        parser.error("--timeout must be > 0")
    return args


def config_from_args(args: argparse.Namespace) -> SwarmConfig:
    return SwarmConfig(
        groups=args.groups, agents_per_group=args.agents_per_group, turns=args.turns,
        system_tokens=args.system_tokens, task_tokens=args.task_tokens,
        followup_tokens=args.followup_tokens, max_tokens=args.max_tokens,
        temperature=args.temperature, concurrency=args.concurrency, arrival=args.arrival,
        interval_s=args.interval, rate=args.rate, seed=args.seed, model=args.model,
        tools_field=args.tools_field)


def _advance(progress: Progress, task: TaskID, _record: RequestRecord) -> None:
    progress.advance(task)


async def run_all(config: SwarmConfig, endpoints: Sequence[Endpoint], *, rounds: int,
                  page_size: int, timeout_s: float, tokenize: bool,
                  progress: Progress | None) -> list[RunResult]:
    """Every round runs the same workload against each endpoint in turn (never concurrently)."""
    runs = []
    for round_index in range(rounds):
        workload = build_workload(dataclasses.replace(config, seed=config.seed + round_index))
        for endpoint in endpoints:
            on_done = None
            if progress is not None:
                task = progress.add_task(f"{endpoint.label} round {round_index + 1}",
                                         total=workload.num_requests)
                on_done = functools.partial(_advance, progress, task)
            runs.append(await run_workload(workload, endpoint, page_size=page_size,
                                           timeout_s=timeout_s, tokenize=tokenize,
                                           on_request_done=on_done))
    return runs


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        config = config_from_args(args)
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    endpoints = [Endpoint("A", args.url, args.api_key)]
    if args.compare:
        endpoints.append(Endpoint("B", args.compare, args.compare_api_key or args.api_key,
                                  args.compare_model))
    console = Console()
    progress = Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
                        TimeElapsedColumn(), console=console, disable=args.no_progress)
    with progress:
        runs = asyncio.run(run_all(config, endpoints, rounds=args.rounds,
                                   page_size=args.page_size, timeout_s=args.timeout,
                                   tokenize=not args.no_tokenize, progress=progress))
    summaries = [summarize([run for run in runs if run.label == e.label]) for e in endpoints]
    console.print(table(summaries, args.page_size))
    for summary in summaries:
        if summary.tokenize != "ok":
            console.print(f"[yellow]{summary.label}: ideal hit rate unknown: "
                          f"{summary.tokenize}[/yellow]")
    if args.json:
        settings = {**config.to_dict(), "page_size": args.page_size, "rounds": args.rounds,
                    "timeout_s": args.timeout,
                    "endpoints": [{"label": e.label, "url": e.root} for e in endpoints]}
        write_json(args.json, settings, runs, summaries)
        console.print(f"wrote {args.json}")
    return 0 if all(summary.ok for summary in summaries) else 1


if __name__ == "__main__":
    sys.exit(main())
