"""Trace replay: production-shaped multi-turn sessions from a Mooncake FAST'25-format trace,
replayed over live HTTP against `prefixgate serve` and a peer (vLLM CPU) at the same KV memory,
one server after the other in one run (issue #25).

Workload (deterministic given the flags; defaults in brackets, --quick in braces):
  * The trace: --trace [../shared/traces/mooncake_synthetic_trace.jsonl] (any JSONL file in the
    format: ``timestamp`` ms, ``input_length``, ``output_length``, ``hash_ids`` one per 512-token
    block; benchmarks.agent_trace writes one).
  * Sessions, rebuilt from the hashes (benchmarks.trace_workload.link_sessions): a request whose
    hash list starts with an earlier prompt's full blocks continues that request; its turn is
    one deeper. A prefix shared without covering a whole earlier prompt (a common document)
    opens a session of its own, and the cache still sees the shared blocks.
  * Selection: the first --sessions [48] {8} sessions by arrival (--select-seed N: a seeded
    sample instead) that have at least --min-turns [2] requests, each cut to --max-turns [4]
    {3} turns.
  * Tokens: every hash id becomes its own deterministic block of 512 / --scale [32] = 16 token
    ids (seeded by --token-seed [0]; equal ids give equal blocks token for token); a prompt's
    last block is cut to its scaled length. Prompts go as token ids to POST /v1/completions,
    streamed with usage, temperature 0, ``ignore_eos``, max_tokens = output_length /
    --output-scale [1] capped at --max-output [256] {32}.
  * Timing: --mode closed [default]: a session's first request goes at its scaled arrival time,
    and each later turn its scaled trace gap (its timestamp - its parent's) after its parent
    finished, as an agent or a person waits for a reply; --mode open: every request at its
    scaled timestamp. Trace seconds x --time-scale [0.1] {0.02} = replay seconds. The closed
    loop's wall has a floor the server cannot shorten: ``floor_s`` (the longest chain of a
    first turn's send time plus its session's pauses).
  The default selection: 178 requests in 48 sessions, 123k prompt tokens of which 72% are
  reusable prefixes, a working set of ~35k prompt tokens (+9k output tokens) against a 1 GiB
  pool of 23,296 tokens (fp32 SmolLM2-135M), floor 94 s.

Servers, each fresh (empty cache), one after the other, each warmed by one short request:
  * prefixgate: `prefixgate serve --kv-memory GB` [1] plus --prefixgate-args (e.g.
    "--max-num-batched-tokens 2048"); PREFIXGATE_* variables are removed from its environment.
  * --peer vllm: DIR/vllm/serve.sh PORT under --peers-dir with VLLM_CPU_KVCACHE_SPACE = the same
    GiB (vLLM takes whole GiB: --kv-memory must then be an integer), started from its own
    folder; --peer-url URL: a running server (its KV memory is its own business).

Reported per server: wall; ``floor_s``; request E2E p50 and sum; TTFT p50/p90 of all, first and
returning turns (send -> first chunk with text); ITL p50/p90 (gaps between text chunks, pooled
over requests); session completion time p50/p90 (first send -> last response); prompt tokens,
cached tokens (usage.prompt_tokens_details.cached_tokens), hit rate and prefill tokens computed
(prompt - cached); output tokens; errors. Ratios prefixgate / peer (``*_ratio``, lower is better).

    python -m benchmarks.trace --peer vllm --json out/trace.json
    python -m benchmarks.trace --quick                                      # < 1 min a server
    python -m benchmarks.trace --prefixgate-args "--max-num-batched-tokens 2048"
    python -m benchmarks.agent_trace --out out/agent.jsonl && \\
        python -m benchmarks.trace --trace out/agent.jsonl --min-turns 1 --max-turns 99
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shlex
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import httpx

from benchmarks.common import base_parser, free_port, ratio, write_json
from benchmarks.server_process import ServerProcess
from benchmarks.serving import (
    DEFAULT_PEERS_DIR,
    PEERS,
    clean_env,
    peer_command,
    prefixgate_command,
    setup_command,
)
from benchmarks.trace_workload import (
    ReplayRequest,
    Scaling,
    Selection,
    TraceError,
    build_replay,
    closed_loop_floor,
    describe,
    link_sessions,
    load_trace,
    select,
)
from prefixgate.agents.report import percentile

DEFAULT_TRACE = Path(__file__).resolve().parents[2] / "shared" / "traces" / "mooncake_synthetic_trace.jsonl"
DEFAULT_KV_MEMORY_GB = 1.0  # = 23,296 tokens of fp32 SmolLM2-135M KV: the pool
QUICK = {"sessions": 8, "max_turns": 3, "max_output": 32, "time_scale": 0.02}
WARMUP_PROMPT = tuple(range(500, 508))  # below the blocks' token ids: it hits nothing


# ------------------------------------------------------------------------------ client


@dataclass(slots=True)
class Outcome:
    """One request's measurements (seconds; sent_s and done_s from the replay's start)."""

    id: int
    session: int
    turn: int
    sent_s: float = 0.0
    done_s: float = 0.0
    ttft_s: float | None = None
    itl_s: list[float] = field(default_factory=list)
    prompt_tokens: int | None = None
    cached_tokens: int | None = None
    completion_tokens: int | None = None
    finish_reason: str | None = None
    error: str | None = None

    @property
    def e2e_s(self) -> float:
        return self.done_s - self.sent_s


def request_body(request: ReplayRequest, model: str | None) -> dict[str, Any]:
    body: dict[str, Any] = {"prompt": list(request.prompt), "max_tokens": request.max_tokens,
                            "temperature": 0, "ignore_eos": True, "stream": True,
                            "stream_options": {"include_usage": True}}
    if model is not None:
        body["model"] = model
    return body


def _fold(chunk: dict[str, Any], outcome: Outcome) -> bool:
    """Fold one SSE chunk into ``outcome``; True when it carried text."""
    if "error" in chunk:
        error = chunk["error"]
        raise ValueError(f"stream error: {error.get('message') if isinstance(error, dict) else error}")
    text = False
    for choice in chunk.get("choices") or []:
        text = text or bool(choice.get("text"))
        outcome.finish_reason = choice.get("finish_reason") or outcome.finish_reason
    usage = chunk.get("usage")
    if isinstance(usage, dict):
        outcome.prompt_tokens = usage.get("prompt_tokens")
        outcome.completion_tokens = usage.get("completion_tokens")
        details = usage.get("prompt_tokens_details")
        if isinstance(details, dict) and details.get("cached_tokens") is not None:
            outcome.cached_tokens = int(details["cached_tokens"])
    return text


async def send(client: httpx.AsyncClient, request: ReplayRequest, model: str | None,
               origin: float) -> Outcome:
    """Send one request now, streamed; errors land in ``outcome.error`` (the run goes on)."""
    outcome = Outcome(request.id, request.session, request.turn)
    start = time.perf_counter()
    outcome.sent_s = start - origin
    last: float | None = None
    try:
        async with client.stream("POST", "/v1/completions",
                                 json=request_body(request, model)) as response:
            if response.status_code >= 400:
                raw = await response.aread()
                raise ValueError(f"HTTP {response.status_code}: {raw[:300].decode('utf-8', 'replace')}")
            async for line in response.aiter_lines():
                data = line[len("data:"):].strip() if line.startswith("data:") else ""
                if not data or data == "[DONE]":
                    continue
                if _fold(json.loads(data), outcome):
                    now = time.perf_counter()
                    if last is None:
                        outcome.ttft_s = now - start
                    else:
                        outcome.itl_s.append(now - last)
                    last = now
    except (httpx.HTTPError, ValueError) as exc:  # one bad request never ends the run
        outcome.error = f"{type(exc).__name__}: {exc}"
    outcome.done_s = time.perf_counter() - origin
    return outcome


async def replay_requests(base_url: str, model: str | None, replay: list[ReplayRequest],
                          mode: str, timeout_s: float = 900.0) -> tuple[float, list[Outcome]]:
    """Replay the requests (closed loop per session, or open loop); returns (wall, outcomes)."""
    children: dict[int | None, list[ReplayRequest]] = {}
    for request in replay:
        children.setdefault(request.parent if mode == "closed" else None, []).append(request)
    outcomes: list[Outcome] = []
    limits = httpx.Limits(max_connections=len(replay) + 4, keepalive_expiry=2.0)
    async with httpx.AsyncClient(base_url=base_url, limits=limits,
                                 timeout=httpx.Timeout(timeout_s)) as client:
        origin = time.perf_counter()

        async def run(request: ReplayRequest) -> None:
            if request.parent is None or mode == "open":
                await asyncio.sleep(max(0.0, origin + request.at_s - time.perf_counter()))
            else:
                await asyncio.sleep(request.gap_s)  # the pause after its parent finished
            outcomes.append(await send(client, request, model, origin))
            await asyncio.gather(*(run(child) for child in children.get(request.id, [])))

        await asyncio.gather(*(run(request) for request in children.get(None, [])))
        wall_s = time.perf_counter() - origin
    outcomes.sort(key=lambda o: o.id)
    return wall_s, outcomes


async def warm_up(base_url: str, model: str | None) -> str | None:
    """One short request outside the timed run; returns an error message or None."""
    request = ReplayRequest(-1, -1, -1, None, 0, WARMUP_PROMPT, 4, 0.0, 0.0)
    async with httpx.AsyncClient(base_url=base_url, timeout=httpx.Timeout(300)) as client:
        return (await send(client, request, model, time.perf_counter())).error


# ------------------------------------------------------------------------------ figures


def _known_sum(values: list[int | None]) -> int | None:
    known = [v for v in values if v is not None]
    return sum(known) if known else None


def summarise(outcomes: list[Outcome], wall_s: float) -> dict[str, Any]:
    """One server's figures (successful requests only; errors counted)."""
    ok = [o for o in outcomes if o.error is None]
    ttft = {"": [o.ttft_s for o in ok if o.ttft_s is not None]}
    ttft["first_"] = [o.ttft_s for o in ok if o.ttft_s is not None and o.turn == 0]
    ttft["returning_"] = [o.ttft_s for o in ok if o.ttft_s is not None and o.turn > 0]
    sessions: dict[int, list[Outcome]] = {}
    for outcome in ok:
        sessions.setdefault(outcome.session, []).append(outcome)
    completion = [max(o.done_s for o in os_) - min(o.sent_s for o in os_)
                  for os_ in sessions.values()]
    itl = [gap for o in ok for gap in o.itl_s]
    prompt = _known_sum([o.prompt_tokens for o in ok])
    cached = _known_sum([o.cached_tokens for o in ok])
    errors = [o.error for o in outcomes if o.error is not None]
    figures: dict[str, Any] = {
        "requests": len(outcomes), "ok": len(ok), "errors": len(errors),
        "first_error": errors[0] if errors else None, "wall_s": wall_s,
        "e2e_p50_s": percentile([o.e2e_s for o in ok], 50),
        "e2e_sum_s": sum(o.e2e_s for o in ok),
        "itl_p50_s": percentile(itl, 50), "itl_p90_s": percentile(itl, 90),
        "session_p50_s": percentile(completion, 50), "session_p90_s": percentile(completion, 90),
        "prompt_tokens": prompt, "cached_tokens": cached,
        "hit_rate": ratio(cached, prompt),
        "prefill_tokens": prompt - cached if prompt is not None and cached is not None else None,
        "output_tokens": _known_sum([o.completion_tokens for o in ok]),
    }
    for kind, values in ttft.items():
        figures[f"ttft_{kind}p50_s"] = percentile(values, 50)
        figures[f"ttft_{kind}p90_s"] = percentile(values, 90)
    return figures


RATIO_KEYS = ("wall_s", "e2e_p50_s", "e2e_sum_s", "ttft_p50_s", "ttft_p90_s", "ttft_first_p50_s",
              "ttft_returning_p50_s", "ttft_returning_p90_s", "itl_p50_s", "itl_p90_s",
              "session_p50_s", "session_p90_s", "prefill_tokens", "hit_rate")


def ratios(ours: dict[str, Any], theirs: dict[str, Any] | None) -> dict[str, float | None]:
    """prefixgate / peer for each headline figure (None without a usable peer run)."""
    usable = theirs is not None and theirs.get("ok", 0) > 0 and ours.get("ok", 0) > 0
    return {key.removesuffix("_s") + "_ratio": ratio(ours.get(key), theirs.get(key))
            if usable and theirs is not None else None for key in RATIO_KEYS}


# ------------------------------------------------------------------------------ servers


@dataclass(frozen=True, slots=True)
class Servers:
    """Which servers to run and how (see the module docstring)."""

    kv_memory: float = DEFAULT_KV_MEMORY_GB
    prefixgate_args: tuple[str, ...] = ()
    peer: str | None = None  # "vllm" (started here from its serve.sh)
    peer_url: str | None = None  # or a running server
    peer_name: str | None = None
    peer_model: str | None = None
    peers_dir: Path = DEFAULT_PEERS_DIR
    timeout_s: float = 900.0
    start_timeout_s: float = 600.0

    @property
    def name_of_peer(self) -> str | None:
        return self.peer_name or self.peer or ("peer" if self.peer_url else None)


def _cache_stats(base_url: str) -> dict[str, Any] | None:
    """prefixgate's /v1/cache/stats (None from a server without it)."""
    try:
        response = httpx.get(base_url + "/v1/cache/stats", timeout=30)
        return response.json() if response.status_code == 200 else None
    except (httpx.HTTPError, ValueError):
        return None


def run_server(name: str, base_url: str, model: str | None, replay: list[ReplayRequest],
               mode: str, timeout_s: float) -> dict[str, Any]:
    """Warm up, replay, summarise one running server."""
    loadavg = os.getloadavg()[0]
    print(f"[{name}] warm-up, then {len(replay)} requests ({mode} loop) ...", flush=True)
    warm_error = asyncio.run(warm_up(base_url, model))
    wall_s, outcomes = asyncio.run(replay_requests(base_url, model, replay, mode, timeout_s))
    summary = summarise(outcomes, wall_s)
    summary.update(name=name, url=base_url, model=model, warmup_error=warm_error,
                   loadavg_1min_start=loadavg, loadavg_1min_end=os.getloadavg()[0],
                   cache_stats=_cache_stats(base_url),
                   outcomes=[{k: v for k, v in asdict(o).items() if k != "itl_s"}
                             for o in outcomes])
    print(f"[{name}] wall {wall_s:.1f} s, {summary['ok']}/{summary['requests']} ok"
          + (f", first error: {summary['first_error']}" if summary["errors"] else ""), flush=True)
    return summary


def _run_process(process: ServerProcess, model: str | None, replay: list[ReplayRequest],
                 mode: str, servers: Servers) -> dict[str, Any]:
    try:
        startup_s, ids = process.wait_ready(servers.start_timeout_s)
        summary = run_server(process.name, process.base_url, model or (ids[0] if ids else None),
                             replay, mode, servers.timeout_s)
        summary.update(startup_s=startup_s, command=" ".join(process.command))
        return summary
    finally:
        process.stop()


def run_prefixgate(replay: list[ReplayRequest], mode: str, servers: Servers) -> dict[str, Any]:
    env, removed = clean_env()
    if removed:
        print(f"[prefixgate] removed from its environment: {', '.join(removed)}")
    port = free_port()
    command = [*prefixgate_command(port), "--kv-memory", f"{servers.kv_memory:g}",
               *servers.prefixgate_args]
    return _run_process(ServerProcess("prefixgate", command, port, env), None, replay, mode,
                        servers)


def run_peer(replay: list[ReplayRequest], mode: str, servers: Servers) -> dict[str, Any]:
    """The peer: a running --peer-url, or --peer started from its own folder at the same KV."""
    name = servers.name_of_peer or "peer"
    if servers.peer_url:
        base = servers.peer_url.rstrip("/").removesuffix("/v1")
        summary = run_server(name, base, servers.peer_model, replay, mode, servers.timeout_s)
        summary.update(startup_s=None, command=None)
        return summary
    port = free_port()
    command = peer_command(servers.peer or "vllm", servers.peers_dir, port, 1)
    if command is None:
        raise RuntimeError(f"peer {servers.peer!r} is not installed under {servers.peers_dir}; "
                           f"set it up with: {setup_command(servers.peer or 'vllm', servers.peers_dir)}")
    env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": f"{servers.kv_memory:g}"}
    # NOTE: started in its own folder: from the checkout, vLLM's model-inspection subprocess
    # imports this repository's kernels/ package and the peer fails to start
    process = ServerProcess(name, command, port, env, cwd=Path(command[0]).parent)
    return _run_process(process, servers.peer_model or "default", replay, mode, servers)


def check_servers(servers: Servers) -> str | None:
    """Why these servers cannot run (None when they can): checked before anything starts."""
    if servers.peer and servers.peer_url:
        return "give --peer or --peer-url, not both"
    if servers.peer and servers.peer not in PEERS:
        return f"unknown peer {servers.peer!r} (choose from {', '.join(sorted(PEERS))})"
    if servers.peer == "llama-server":
        return "llama-server computes each slot's prompt apart (no shared prefix): use --peer vllm"
    if servers.peer and peer_command(servers.peer, servers.peers_dir, 0, 1) is None:
        return (f"peer {servers.peer!r} is not installed under {servers.peers_dir}; set it up "
                f"with:\n  {setup_command(servers.peer, servers.peers_dir)}")
    if servers.peer == "vllm" and servers.kv_memory != int(servers.kv_memory):
        return f"vLLM takes whole GiB of KV memory: --kv-memory {servers.kv_memory:g} is not one"
    return None


def compare(replay: list[ReplayRequest], mode: str, servers: Servers) -> dict[str, Any]:
    """prefixgate, then the peer if any, on the same replay; their figures and the ratios."""
    ours = run_prefixgate(replay, mode, servers)
    theirs = run_peer(replay, mode, servers) if servers.name_of_peer else None
    return {"peer": servers.name_of_peer, **ratios(ours, theirs),
            "servers": {s["name"]: s for s in (ours, theirs) if s is not None}}


# ------------------------------------------------------------------------------ report


ROWS = (("wall_s", "wall (s)"), ("e2e_p50_s", "request E2E p50 (s)"),
        ("e2e_sum_s", "request E2E sum (s)"), ("ttft_p50_s", "TTFT p50 (s)"),
        ("ttft_p90_s", "TTFT p90 (s)"), ("ttft_first_p50_s", "first-turn TTFT p50 (s)"),
        ("ttft_first_p90_s", "first-turn TTFT p90 (s)"),
        ("ttft_returning_p50_s", "returning-turn TTFT p50 (s)"),
        ("ttft_returning_p90_s", "returning-turn TTFT p90 (s)"), ("itl_p50_s", "ITL p50 (s)"),
        ("itl_p90_s", "ITL p90 (s)"), ("session_p50_s", "session completion p50 (s)"),
        ("session_p90_s", "session completion p90 (s)"), ("prompt_tokens", "prompt tokens"),
        ("cached_tokens", "cached tokens"), ("hit_rate", "cached / prompt"),
        ("prefill_tokens", "prefill tokens computed"), ("output_tokens", "output tokens"),
        ("errors", "errors"), ("startup_s", "startup (s)"),
        ("loadavg_1min_start", "load avg at start"))


def shown(value: Any) -> str:
    if value is None:
        return "-"
    return f"{value:.4g}" if isinstance(value, float) else str(value)


def print_report(title: str, servers: list[dict[str, Any]],
                 rows: tuple[tuple[str, str], ...] = ROWS) -> None:
    """A table: one column per server, and ours / theirs when there are two."""
    names = [s["name"] for s in servers]
    header = ["", *names] + ([f"{names[0]}/{names[1]}"] if len(servers) == 2 else [])
    lines = [header]
    for key, label in rows:
        line = [label, *(shown(s.get(key)) for s in servers)]
        if len(servers) == 2:
            line.append(shown(ratio(servers[0].get(key), servers[1].get(key))))
        lines.append(line)
    widths = [max(len(line[i]) for line in lines) for i in range(len(header))]
    print(f"\n{title}\n" + "-" * (sum(widths) + 2 * len(widths)))
    for line in lines:
        print("  ".join(cell.ljust(w) if i == 0 else cell.rjust(w)
                        for i, (cell, w) in enumerate(zip(line, widths, strict=True))))


# ------------------------------------------------------------------------------ CLI


def add_workload_arguments(parser: argparse.ArgumentParser) -> None:
    """The trace, selection, scaling and timing flags (shared with benchmarks.suite)."""
    selection, scaling = Selection(), Scaling()
    parser.add_argument("--trace", type=Path, default=DEFAULT_TRACE, help="JSONL trace file")
    parser.add_argument("--mode", choices=("closed", "open"), default="closed",
                        help="closed loop per session (default) or open loop at the timestamps")
    parser.add_argument("--sessions", type=int, default=selection.sessions)
    parser.add_argument("--min-turns", type=int, default=selection.min_turns)
    parser.add_argument("--max-turns", type=int, default=selection.max_turns)
    parser.add_argument("--select-seed", type=int, default=None,
                        help="a seeded sample of sessions instead of the first ones")
    parser.add_argument("--scale", type=int, default=scaling.scale,
                        help="lengths / SCALE (512-token blocks -> 512/SCALE tokens)")
    parser.add_argument("--output-scale", type=float, default=scaling.output_scale)
    parser.add_argument("--max-output", type=int, default=scaling.max_output)
    parser.add_argument("--time-scale", type=float, default=scaling.time_scale,
                        help="trace seconds x TIME_SCALE = replay seconds")
    parser.add_argument("--token-seed", type=int, default=scaling.token_seed)
    parser.add_argument("--quick", action="store_true", help="a small preset (< 1 min a server)")


def workload_from_args(args: argparse.Namespace) -> tuple[Selection, Scaling]:
    """The selection and scaling the flags ask for (--quick overrides the defaults it names)."""
    defaults = {**asdict(Selection()), **asdict(Scaling())}
    if args.quick:  # the preset fills in what the flags left at their defaults
        for key, value in QUICK.items():
            if key in defaults and getattr(args, key) == defaults[key]:
                setattr(args, key, value)
    selection = Selection(args.sessions, args.min_turns, args.max_turns, args.select_seed)
    scaling = Scaling(args.scale, args.output_scale, args.max_output, args.time_scale,
                      token_seed=args.token_seed)
    return selection, scaling


def build_from_args(args: argparse.Namespace) -> tuple[list[ReplayRequest], dict[str, Any]]:
    """The replay the flags describe and its workload figures."""
    selection, scaling = workload_from_args(args)
    requests = load_trace(args.trace)
    links = link_sessions(requests)
    replay = build_replay(requests, links, select(requests, links, selection), scaling)
    if not replay:
        raise TraceError(f"{args.trace}: no session has >= {selection.min_turns} requests")
    workload = {"trace": str(args.trace), "mode": args.mode, **asdict(selection),
                **asdict(scaling), "block_tokens": scaling.block_tokens,
                **describe(replay, scaling.block_tokens),
                "longest_request_tokens": max(len(r.prompt) + r.max_tokens for r in replay),
                "floor_s": closed_loop_floor(replay) if args.mode == "closed"
                else max(r.at_s for r in replay)}
    return replay, workload


def add_server_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--kv-memory", type=float, default=DEFAULT_KV_MEMORY_GB, metavar="GB",
                        help="KV memory of every server, GiB (default 1)")
    parser.add_argument("--prefixgate-args", default="",
                        help="extra `prefixgate serve` flags, e.g. '--max-num-batched-tokens 2048'")
    peer = parser.add_mutually_exclusive_group()
    peer.add_argument("--peer", choices=sorted(PEERS), help="start this peer from its serve.sh")
    peer.add_argument("--peer-url", help="an OpenAI-compatible server that is already running")
    parser.add_argument("--peer-name")
    parser.add_argument("--peer-model")
    parser.add_argument("--peers-dir", type=Path, default=DEFAULT_PEERS_DIR)
    parser.add_argument("--timeout", type=float, default=900.0, help="per request, seconds")
    parser.add_argument("--start-timeout", type=float, default=600.0)


def servers_from_args(args: argparse.Namespace) -> Servers:
    return Servers(args.kv_memory, tuple(shlex.split(args.prefixgate_args)), args.peer, args.peer_url,
                   args.peer_name, args.peer_model, args.peers_dir, args.timeout,
                   args.start_timeout)


def main(argv: list[str] | None = None) -> int:
    parser = base_parser(__doc__.splitlines()[0])
    add_workload_arguments(parser)
    add_server_arguments(parser)
    args = parser.parse_args(argv)
    try:
        replay, workload = build_from_args(args)
        servers = servers_from_args(args)
    except (TraceError, ValueError, OSError) as exc:
        parser.error(str(exc))
    problem = check_servers(servers)
    if problem:
        print(problem, file=sys.stderr)
        return 2
    print("workload: " + ", ".join(f"{k}={shown(v)}" for k, v in workload.items()), flush=True)
    results = {"workload": workload, "kv_memory_gb": servers.kv_memory,
               "prefixgate_args": list(servers.prefixgate_args),
               **compare(replay, args.mode, servers)}
    print_report(f"trace replay ({args.mode} loop, {workload['sessions']} sessions, "
                 f"{workload['requests']} requests, {workload['prompt_tokens']} prompt tokens, "
                 f"KV {servers.kv_memory:g} GiB each; closed-loop floor "
                 f"{workload['floor_s']:.1f} s) (benchmarks.trace)",
                 list(results["servers"].values()))
    print("\n" + "  ".join(f"{k}={shown(v)}" for k, v in results.items() if k.endswith("_ratio")))
    write_json(args.json, results)
    return 0 if all(s["ok"] for s in results["servers"].values()) else 1


if __name__ == "__main__":
    sys.exit(main())
