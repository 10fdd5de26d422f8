"""Serving benchmark: a live-HTTP agent swarm against `prefixgate serve` and a peer server
(vLLM CPU, llama-server, or any OpenAI-compatible URL), one after the other in one run (#18).

Workload (deterministic given --seed [0]; defaults in brackets):
  * One shared system prompt of about --prompt-tokens [2000] real tokens (role, rules, JSON tool
    schemas embedded as text, policies: prefixgate.agents.texts via agents.workload, one group;
    the approximate-token budget is scaled by PROMPT_TOKEN_SCALE, calibrated on SmolLM2's
    tokenizer; the real count shows as ``prompt_tokens_turn1_min``).
  * --agents [16] agents, each with its own task (~50 tokens), run --turns [4] turns. Each turn
    re-sends the whole conversation: system + task + every earlier reply + a follow-up (~35
    tokens: half tool results, half user follow-ups, seeded). All agents start together (a
    burst); an agent sends its next turn as soon as its previous one has finished.
  * Each request: POST /v1/chat/completions, streamed (stream_options.include_usage), greedy
    (temperature 0), max_tokens --max-tokens [32] and ``ignore_eos: true`` (prefixgate, vLLM and
    llama-server all take it; --no-ignore-eos drops it for servers that refuse unknown fields),
    so every request produces 32 tokens; the output tokens actually produced are reported
    (usage.completion_tokens; streamed chunks when a server reports no usage).
  * --tool-loop: the tool-calling variant instead. The system prompt without the schemas; the
    schemas in the OpenAI ``tools`` field (sizes bounded: strings <= 12 chars, integers <=
    1000, arrays <= 2 items, maps <= 2 keys, so a greedy 135M model writes a short call),
    ``tool_choice: "required"``, ``parallel_tool_calls: false``, max_tokens --tool-max-tokens
    [64], no ignore_eos (the grammar ends the call). The next turn appends the assistant
    message with its tool_calls and one ``role: "tool"`` result per call (~35 tokens, seeded per
    agent and turn); a reply without calls is appended as text with a user follow-up. A peer
    that rejects every request (possible: vLLM's serve.sh does not set
    --enable-auto-tool-choice, llama-server's does not pass --jinja) makes the variant
    prefixgate-only: ``peer_tool_loop`` says why (else "ok"). NOTE: the
    prompts differ between servers here: prefixgate renders the tools into the prompt, a server
    whose chat template ignores tools may not.

Servers, each fresh (started by this run, empty cache) and stopped by PID with SIGTERM, then
its process group (SIGKILL after 30 s):
  * prefixgate: `prefixgate serve --host 127.0.0.1 --port <free>` with default flags plus
    --prefixgate-args [none] (PREFIXGATE_* variables are removed from its environment); the
    model id is read from /v1/models.
  * --peer vllm|llama-server: DIR/vllm/serve.sh PORT or DIR/llama-server/serve.sh PORT SLOTS
    (SLOTS = --agents) under --peers-dir [~/.cache/prefixgate-peers], model id ``default``; if the
    peer is not installed there, the benchmark prints the setup command and exits 2.
  * --peer-url URL [--peer-name NAME]: an already-running server (model: --peer-model, else its
    first /v1/models id, else ``default``); it may be warm from earlier runs and its RSS is unknown.
Each server gets one short warm-up request (a different prompt, 4 tokens) before the timed run,
so first-call costs (kernel builds, allocator warm-up) stay out of the swarm. prefixgate runs
first, then the peer.

Reported per server: wall (first send -> last response), TTFT p50/p90 measured client-side (send
-> first chunk carrying content or tool-call text), TTFT p50 of turn 1 (cold prefix) and of later
turns, e2e p50, output tokens and output tokens/s over the wall, prompt and cached tokens
(usage.prompt_tokens_details.cached_tokens; None when not reported), errors, startup time, and
the server's RSS after the run (/proc/PID/status VmRSS, its peak VmHWM, and the sum of VmRSS
over the process and its descendants: vLLM's engine core is a child; ``rss_idle_mb`` is that
sum once /v1/models first answers, before any request). Ratios = prefixgate /
peer: ``wall_ratio``, ``ttft_p50_ratio``, ``ttft_p90_ratio``, ``output_tokens_per_s_ratio``,
``rss_tree_ratio`` (lower is better for prefixgate except tokens/s).

Noise: servers run one after the other, so load from other processes lands on one side only.
prefixgate against itself as the peer (same workload) gave wall ratios of 0.79 and 1.08 at load
averages of 6-7 on a shared 2-core machine; the load average at each start is in the table.

    python -m benchmarks.serving --json out/serving.json                      # prefixgate alone
    python -m benchmarks.serving --peer vllm --json out/serving_vllm.json
    python -m benchmarks.serving --peer llama-server --json out/serving_llama.json
    python -m benchmarks.serving --peer-url http://127.0.0.1:8001 --peer-name mine
    python -m benchmarks.serving --agents 4 --turns 2 --prompt-tokens 1000        # smoke run
    python -m benchmarks.serving --tool-loop --peer vllm
"""

from __future__ import annotations

import asyncio
import json
import os
import random
import shlex
import sys
import time
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

import httpx

from benchmarks.common import base_parser, bounded_schema, free_port, ratio, write_json
from benchmarks.server_process import ServerProcess, memory_mb
from prefixgate.agents import texts
from prefixgate.agents.report import percentile
from prefixgate.agents.runner import read_usage
from prefixgate.agents.workload import Agent, SwarmConfig, Workload, build_workload

# agents.texts counts words + punctuation; SmolLM2's tokenizer makes ~0.94 real tokens of each
# (a 2,000-approx-token system prompt is 1,887 tokens), so budgets are scaled to hit real counts.
PROMPT_TOKEN_SCALE = 1.06
TASK_TOKENS, FOLLOWUP_TOKENS = 50, 35
PEERS = {"vllm": ("vllm", "vllm_cpu.sh"), "llama-server": ("llama-server", "llama_server.sh")}
PEER_SCRIPTS = Path(__file__).resolve().parents[2] / "shared" / "peers"
DEFAULT_PEERS_DIR = Path.home() / ".cache" / "prefixgate-peers"
WARMUP_MESSAGES = [{"role": "user", "content": "Say hello."}]


# ------------------------------------------------------------------------------ workload


@dataclass(frozen=True, slots=True)
class Settings:
    """The benchmark's workload knobs (see the module docstring)."""

    agents: int = 16
    turns: int = 4
    prompt_tokens: int = 2000
    max_tokens: int = 32
    tool_max_tokens: int = 64
    tool_loop: bool = False
    ignore_eos: bool = True
    seed: int = 0

    def __post_init__(self) -> None:
        for name in ("agents", "turns", "prompt_tokens", "max_tokens", "tool_max_tokens"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")

    @property
    def request_max_tokens(self) -> int:
        return self.tool_max_tokens if self.tool_loop else self.max_tokens


def build_swarm(settings: Settings) -> Workload:
    """The agents (one group sharing the system prompt); the same settings give the same swarm."""
    config = SwarmConfig(
        groups=1, agents_per_group=settings.agents, turns=settings.turns,
        system_tokens=round(settings.prompt_tokens * PROMPT_TOKEN_SCALE),
        task_tokens=TASK_TOKENS, followup_tokens=FOLLOWUP_TOKENS,
        max_tokens=settings.request_max_tokens, temperature=0.0,
        concurrency=settings.agents, arrival="burst", seed=settings.seed,
        tools_field=settings.tool_loop)
    return build_workload(config)


def tool_specs(agent: Agent) -> list[dict]:
    """The agent's tools for the ``tools`` field, parameters bounded."""
    tools = []
    for tool in agent.tools:
        function = dict(tool["function"])
        function["parameters"] = bounded_schema(function["parameters"])
        tools.append({"type": "function", "function": function})
    return tools


def tool_result_text(settings: Settings, agent_index: int, turn: int, tool_name: str) -> str:
    """The result an agent's tool returns after ``turn`` (seeded per agent and turn)."""
    rng = random.Random(f"serving/{settings.seed}/agent{agent_index}/turn{turn}")
    return texts.tool_result(rng, tool_name, FOLLOWUP_TOKENS)


def request_body(settings: Settings, model: str | None, messages: list[dict],
                 tools: list[dict] | None, agent_id: str) -> dict:
    """One streamed chat request of the swarm."""
    body: dict[str, Any] = {"messages": messages, "max_tokens": settings.request_max_tokens,
                            "temperature": 0, "stream": True,
                            "stream_options": {"include_usage": True}, "user": agent_id}
    if model is not None:
        body["model"] = model
    if settings.tool_loop:
        body.update(tools=tools, tool_choice="required", parallel_tool_calls=False)
    elif settings.ignore_eos:
        body["ignore_eos"] = True
    return body


# ------------------------------------------------------------------------------ client


@dataclass(slots=True)
class Record:
    """One request (times in seconds since the run started / since its send)."""

    agent: int
    turn: int
    start_s: float
    ttft_s: float | None = None
    e2e_s: float | None = None
    prompt_tokens: int | None = None
    completion_tokens: int | None = None
    cached_tokens: int | None = None
    output_chunks: int = 0
    finish_reason: str | None = None
    tool_calls: int = 0
    error: str | None = None

    @property
    def output_tokens(self) -> int:
        """Tokens produced: usage when reported, else streamed chunks (a lower bound)."""
        return self.completion_tokens if self.completion_tokens is not None else self.output_chunks


@dataclass(slots=True)
class Reply:
    text: str = ""
    tool_calls: list[dict] = field(default_factory=list)


def _fold_chunk(chunk: dict, record: Record, text: list[str], calls: dict[int, dict]) -> bool:
    """Fold one SSE chunk into the record; True when it carried output."""
    if "error" in chunk:
        error = chunk["error"]
        raise ValueError(f"stream error: {error.get('message') if isinstance(error, dict) else error}")
    produced = False
    for choice in chunk.get("choices") or []:
        delta = choice.get("delta") or {}
        if delta.get("content"):
            text.append(delta["content"])
            produced = True
        for call in delta.get("tool_calls") or []:
            slot = calls.setdefault(call.get("index", 0), {"id": None, "name": "", "arguments": ""})
            slot["id"] = call.get("id") or slot["id"]
            function = call.get("function") or {}
            slot["name"] += function.get("name") or ""
            slot["arguments"] += function.get("arguments") or ""
            produced = produced or bool(function.get("name") or function.get("arguments"))
        if choice.get("finish_reason"):
            record.finish_reason = choice["finish_reason"]
    read_usage(chunk, record)
    return produced


async def stream_request(client: httpx.AsyncClient, body: dict, record: Record) -> Reply:
    """Send one streamed request, filling ``record``; errors go into ``record.error``."""
    text: list[str] = []
    calls: dict[int, dict] = {}
    start = time.perf_counter()
    try:
        async with client.stream("POST", "/v1/chat/completions", json=body) as response:
            if response.status_code >= 400:
                raw = await response.aread()
                raise ValueError(f"HTTP {response.status_code}: {raw[:300].decode('utf-8', 'replace')}")
            done = False
            async for line in response.aiter_lines():
                if not line.startswith("data:"):
                    continue  # blank separators, comments, event: lines
                data = line[len("data:"):].strip()
                if data == "[DONE]":
                    done = True
                    break
                if _fold_chunk(json.loads(data), record, text, calls):
                    if record.ttft_s is None:
                        record.ttft_s = time.perf_counter() - start
                    record.output_chunks += 1
            if not done:
                raise ValueError("stream ended without data: [DONE]")
    except (httpx.HTTPError, ValueError) as exc:  # one bad request never ends the run
        record.error = f"{type(exc).__name__}: {exc}"
    record.e2e_s = time.perf_counter() - start
    record.tool_calls = len(calls)
    return Reply("".join(text), [calls[index] for index in sorted(calls)])


def next_messages(settings: Settings, agent_index: int, agent: Agent, messages: list[dict],
                  turn: int, reply: Reply) -> list[dict]:
    """The conversation for turn ``turn + 1``: + the reply, + a tool result or a follow-up."""
    if settings.tool_loop and reply.tool_calls:
        calls = [{"id": call["id"] or f"call_{agent_index}_{turn}_{n}", "type": "function",
                  "function": {"name": call["name"], "arguments": call["arguments"]}}
                 for n, call in enumerate(reply.tool_calls)]
        results = [{"role": "tool", "tool_call_id": call["id"],
                    "content": tool_result_text(settings, agent_index, turn, call["function"]["name"])}
                   for call in calls]
        return [*messages, {"role": "assistant", "content": reply.text or None, "tool_calls": calls},
                *results]
    return [*messages, {"role": "assistant", "content": reply.text},
            {"role": "user", "content": agent.followups[turn]}]


async def run_swarm(base_url: str, model: str | None, settings: Settings,
                    timeout_s: float = 600.0) -> tuple[float, list[Record]]:
    """Run every agent of the swarm (all start at once); returns (wall seconds, records)."""
    workload = build_swarm(settings)
    limits = httpx.Limits(max_connections=settings.agents + 4)
    records: list[Record] = []
    async with httpx.AsyncClient(base_url=base_url, limits=limits,
                                 timeout=httpx.Timeout(timeout_s)) as client:
        t0 = time.perf_counter()

        async def agent_loop(index: int, agent: Agent) -> None:
            tools = tool_specs(agent) if settings.tool_loop else None
            messages = agent.messages([])
            for turn in range(agent.turns):
                record = Record(agent=index, turn=turn, start_s=time.perf_counter() - t0)
                body = request_body(settings, model, messages, tools, agent.agent_id)
                reply = await stream_request(client, body, record)
                records.append(record)
                if turn + 1 < agent.turns:
                    messages = next_messages(settings, index, agent, messages, turn, reply)

        await asyncio.gather(*(agent_loop(i, a) for i, a in enumerate(workload.agents)))
        wall_s = time.perf_counter() - t0
    records.sort(key=lambda r: (r.start_s, r.agent))
    return wall_s, records


async def warm_up(base_url: str, model: str | None, ignore_eos: bool) -> str | None:
    """One short request outside the timed run; returns an error message or None."""
    body: dict[str, Any] = {"messages": WARMUP_MESSAGES, "max_tokens": 4, "temperature": 0,
                            "stream": True}
    if model is not None:
        body["model"] = model
    if ignore_eos:
        body["ignore_eos"] = True
    record = Record(agent=-1, turn=0, start_s=0.0)
    async with httpx.AsyncClient(base_url=base_url, timeout=httpx.Timeout(300)) as client:
        await stream_request(client, body, record)
    return record.error


# ------------------------------------------------------------------------------ statistics


def _sum_or_none(values: list[int | None]) -> int | None:
    known = [v for v in values if v is not None]
    return sum(known) if known else None


def summarize(records: list[Record], wall_s: float) -> dict[str, Any]:
    """The figures of one server's run (successful requests only, errors counted)."""
    ok = [r for r in records if r.error is None]
    ttft = [r.ttft_s for r in ok if r.ttft_s is not None]
    output_tokens = sum(r.output_tokens for r in ok)
    prompt_tokens = _sum_or_none([r.prompt_tokens for r in ok])
    cached_tokens = _sum_or_none([r.cached_tokens for r in ok])
    turn1 = [r.prompt_tokens for r in ok if r.turn == 0 and r.prompt_tokens is not None]
    errors = [r.error for r in records if r.error is not None]
    return {
        "requests": len(records),
        "ok": len(ok),
        "errors": len(errors),
        "first_error": errors[0] if errors else None,
        "wall_s": wall_s,
        "ttft_p50_s": percentile(ttft, 50),
        "ttft_p90_s": percentile(ttft, 90),
        "ttft_p50_turn1_s": percentile([r.ttft_s for r in ok
                                        if r.turn == 0 and r.ttft_s is not None], 50),
        "ttft_p50_later_s": percentile([r.ttft_s for r in ok
                                        if r.turn > 0 and r.ttft_s is not None], 50),
        "e2e_p50_s": percentile([r.e2e_s for r in ok if r.e2e_s is not None], 50),
        "output_tokens": output_tokens,
        "output_tokens_source": ("usage" if ok and all(r.completion_tokens is not None for r in ok)
                                 else "chunks"),
        "output_tokens_per_s": output_tokens / wall_s if wall_s > 0 else None,
        "prompt_tokens": prompt_tokens,
        "prompt_tokens_turn1_min": min(turn1) if turn1 else None,
        "cached_tokens": cached_tokens,
        "cached_tokens_reported": sum(r.cached_tokens is not None for r in ok),
        "hit_rate": cached_tokens / prompt_tokens if cached_tokens is not None and prompt_tokens
        else None,
        "finish_reasons": {reason: sum(r.finish_reason == reason for r in ok)
                           for reason in sorted({str(r.finish_reason) for r in ok})},
        "tool_calls": sum(r.tool_calls for r in ok),
    }


def ratios(ours: dict[str, Any], theirs: dict[str, Any] | None) -> dict[str, float | None]:
    """prefixgate / peer for the headline figures (all None without a usable peer run)."""
    keys = {"wall_ratio": "wall_s", "ttft_p50_ratio": "ttft_p50_s",
            "ttft_p90_ratio": "ttft_p90_s", "output_tokens_per_s_ratio": "output_tokens_per_s",
            "rss_tree_ratio": "rss_tree_mb"}
    usable = theirs is not None and theirs.get("ok", 0) > 0 and ours.get("ok", 0) > 0
    return {name: ratio(ours.get(key), theirs.get(key)) if usable else None
            for name, key in keys.items()}


# ------------------------------------------------------------------------------ processes


def prefixgate_command(port: int) -> list[str]:
    """`prefixgate serve` with default flags (the console script beside this interpreter)."""
    script = Path(sys.executable).parent / "prefixgate"
    head = [str(script)] if script.exists() else [sys.executable, "-m", "prefixgate.gateway.cli"]
    return [*head, "serve", "--host", "127.0.0.1", "--port", str(port)]


def clean_env() -> tuple[dict[str, str], list[str]]:
    """This environment less PREFIXGATE_* (they would change the defaults); and what went."""
    removed = sorted(k for k in os.environ if k.startswith("PREFIXGATE_"))
    return {k: v for k, v in os.environ.items() if k not in removed}, removed


def prefixgate_process(kv_memory_gb: float, extra_args: str = "") -> ServerProcess:
    """A `prefixgate serve --kv-memory GB` on a free port with ``extra_args`` (a shell-quoted
    string), in a clean environment; not started until waited for (``wait_ready``)."""
    env, _ = clean_env()
    port = free_port()
    command = [*prefixgate_command(port), "--kv-memory", f"{kv_memory_gb:g}",
               *shlex.split(extra_args)]
    return ServerProcess("prefixgate", command, port, env)


def peer_command(peer: str, peers_dir: Path, port: int, slots: int) -> list[str] | None:
    """The command starting an installed peer, or None when it is not installed."""
    folder, _ = PEERS[peer]
    serve = peers_dir / folder / "serve.sh"
    if not (serve.is_file() and os.access(serve, os.X_OK)):
        return None
    return [str(serve), str(port)] + ([str(slots)] if peer == "llama-server" else [])


def setup_command(peer: str, peers_dir: Path) -> str:
    script = PEER_SCRIPTS / PEERS[peer][1]
    shown = script if script.exists() else Path("../shared/peers") / PEERS[peer][1]
    return f"bash {shown} {peers_dir}"


# ------------------------------------------------------------------------------ one server


def run_server(name: str, base_url: str, model: str | None, settings: Settings,
               process: ServerProcess | None, timeout_s: float) -> dict[str, Any]:
    """Warm up, run the swarm and summarise it (memory read after the run, while it is up).

    A server that refuses ``ignore_eos`` in the warm-up (HTTP 4xx) runs without it: its
    answers may then be shorter, and the output tokens it really produced are what counts.
    """
    idle = memory_mb(process.pid) if process is not None else {}
    loadavg = os.getloadavg()[0]
    print(f"[{name}] warm-up, then {settings.agents} agents x {settings.turns} turns ...",
          flush=True)
    ignore_eos = settings.ignore_eos and not settings.tool_loop
    warm_error = asyncio.run(warm_up(base_url, model, ignore_eos))
    if (warm_error and ignore_eos and warm_error.startswith("ValueError: HTTP 4")
            and asyncio.run(warm_up(base_url, model, False)) is None):
        print(f"[{name}] refuses ignore_eos ({warm_error}); running without it")
        settings, warm_error = replace(settings, ignore_eos=False), None
    wall_s, records = asyncio.run(run_swarm(base_url, model, settings, timeout_s))
    summary = summarize(records, wall_s)
    summary.update(name=name, url=base_url, model=model, warmup_error=warm_error,
                   ignore_eos_sent=settings.ignore_eos and not settings.tool_loop,
                   loadavg_1min_start=loadavg, loadavg_1min_end=os.getloadavg()[0],
                   rss_idle_mb=idle.get("rss_tree_mb"))
    if process is not None:
        summary.update(memory_mb(process.pid), pid=process.pid)
    else:
        summary.update(rss_mb=None, rss_hwm_mb=None, rss_tree_mb=None)
    summary["records"] = [asdict(r) for r in records]
    print(f"[{name}] wall {wall_s:.2f} s, {summary['ok']}/{summary['requests']} ok", flush=True)
    return summary


def run_prefixgate(settings: Settings, args: Any) -> dict[str, Any]:
    env, removed = clean_env()
    if removed:
        print(f"[prefixgate] removed from its environment (default flags): {', '.join(removed)}")
    port = free_port()
    command = [*prefixgate_command(port), *shlex.split(getattr(args, "prefixgate_args", ""))]
    process = ServerProcess("prefixgate", command, port, env)
    try:
        startup_s, ids = process.wait_ready(args.start_timeout)
        summary = run_server("prefixgate", process.base_url, ids[0] if ids else None, settings,
                             process, args.timeout)
        summary.update(startup_s=startup_s, command=" ".join(process.command))
        return summary
    finally:
        process.stop()


def run_peer(settings: Settings, args: Any) -> dict[str, Any]:
    if args.peer_url:
        base = args.peer_url.rstrip("/").removesuffix("/v1")
        model = args.peer_model
        if model is None:
            try:
                data = httpx.get(base + "/v1/models", timeout=10).json()["data"]
                model = str(data[0]["id"]) if data else "default"
            except (httpx.HTTPError, ValueError, KeyError, IndexError, TypeError):
                model = "default"
        summary = run_server(args.peer_name, base, model, settings, None, args.timeout)
        summary.update(startup_s=None, command=None, started_here=False)
        return summary
    port = free_port()
    command = peer_command(args.peer, args.peers_dir, port, settings.agents)
    assert command is not None  # checked in main() before prefixgate ran
    # NOTE: started in its own folder: from the repository root, Python subprocesses of the
    # peer (vLLM inspects the model in one) import this repository's kernels/ package in place
    # of the `kernels` package transformers probes for, and the peer fails to start
    process = ServerProcess(args.peer_name, command, port, cwd=Path(command[0]).parent)
    try:
        startup_s, _ = process.wait_ready(args.start_timeout)
        summary = run_server(args.peer_name, process.base_url, args.peer_model or "default",
                             settings, process, args.timeout)
        summary.update(startup_s=startup_s, command=" ".join(command), started_here=True)
        return summary
    finally:
        process.stop()


# ------------------------------------------------------------------------------ report


ROWS = (("wall_s", "wall (s)"), ("ttft_p50_s", "TTFT p50 (s)"), ("ttft_p90_s", "TTFT p90 (s)"),
        ("ttft_p50_turn1_s", "TTFT p50 turn 1 (s)"), ("ttft_p50_later_s", "TTFT p50 turns 2+ (s)"),
        ("e2e_p50_s", "e2e p50 (s)"), ("output_tokens", "output tokens"),
        ("output_tokens_per_s", "output tokens/s"), ("prompt_tokens", "prompt tokens"),
        ("prompt_tokens_turn1_min", "turn-1 prompt tokens (min)"),
        ("cached_tokens", "cached tokens"), ("hit_rate", "cached / prompt"),
        ("tool_calls", "tool calls"), ("errors", "errors"), ("startup_s", "startup (s)"),
        ("rss_idle_mb", "RSS before the run (MiB)"), ("rss_mb", "server RSS after (MiB)"),
        ("rss_tree_mb", "RSS after, incl. children (MiB)"),
        ("loadavg_1min_start", "load avg at start"))


def _shown(value: Any) -> str:
    if value is None:
        return "-"
    return f"{value:.4g}" if isinstance(value, float) else str(value)


def print_report(title: str, servers: list[dict[str, Any]]) -> None:
    names = [s["name"] for s in servers]
    header = ["", *names] + ([f"{names[0]}/{names[1]}"] if len(servers) == 2 else [])
    lines = [header]
    for key, label in ROWS:
        row = [label, *(_shown(s.get(key)) for s in servers)]
        if len(servers) == 2:
            row.append(_shown(ratio(servers[0].get(key), servers[1].get(key)))
                       if isinstance(servers[0].get(key), int | float) else "-")
        lines.append(row)
    widths = [max(len(line[i]) for line in lines) for i in range(len(header))]
    print(f"\n{title}\n" + "-" * (sum(widths) + 2 * len(widths)))
    for line in lines:
        print("  ".join(cell.ljust(w) if i == 0 else cell.rjust(w)
                        for i, (cell, w) in enumerate(zip(line, widths, strict=True))))
    for server in servers:
        if server.get("first_error"):
            print(f"{server['name']}: {server['errors']} errors, first: {server['first_error']}")


def main(argv: list[str] | None = None) -> int:
    parser = base_parser(__doc__.splitlines()[0])
    defaults = Settings()
    parser.add_argument("--agents", type=int, default=defaults.agents)
    parser.add_argument("--turns", type=int, default=defaults.turns)
    parser.add_argument("--prompt-tokens", type=int, default=defaults.prompt_tokens,
                        help="shared system prompt, real tokens (approx.)")
    parser.add_argument("--max-tokens", type=int, default=defaults.max_tokens)
    parser.add_argument("--tool-max-tokens", type=int, default=defaults.tool_max_tokens)
    parser.add_argument("--tool-loop", action="store_true", help="the tool-calling variant")
    parser.add_argument("--no-ignore-eos", action="store_true",
                        help="do not send ignore_eos (servers that reject unknown fields)")
    parser.add_argument("--seed", type=int, default=defaults.seed)
    parser.add_argument("--prefixgate-args", default="",
                        help="extra `prefixgate serve` flags (default: none, its defaults)")
    peer = parser.add_mutually_exclusive_group()
    peer.add_argument("--peer", choices=sorted(PEERS), help="start this peer from its serve.sh")
    peer.add_argument("--peer-url", help="an OpenAI-compatible server that is already running")
    parser.add_argument("--peer-name", help="the peer's name in the report (default: --peer, "
                                            "or 'peer' for --peer-url)")
    parser.add_argument("--peer-model", help="model id for the peer (default: 'default' for "
                                             "--peer, the first /v1/models id for --peer-url)")
    parser.add_argument("--peers-dir", type=Path, default=DEFAULT_PEERS_DIR)
    parser.add_argument("--timeout", type=float, default=600.0, help="per request, seconds")
    parser.add_argument("--start-timeout", type=float, default=600.0,
                        help="seconds to wait for a started server's /v1/models")
    args = parser.parse_args(argv)
    try:
        settings = Settings(agents=args.agents, turns=args.turns, prompt_tokens=args.prompt_tokens,
                            max_tokens=args.max_tokens, tool_max_tokens=args.tool_max_tokens,
                            tool_loop=args.tool_loop, ignore_eos=not args.no_ignore_eos,
                            seed=args.seed)
    except ValueError as exc:
        parser.error(str(exc))
    args.peer_name = args.peer_name or args.peer or ("peer" if args.peer_url else None)
    if args.peer and peer_command(args.peer, args.peers_dir, 0, 1) is None:
        print(f"peer {args.peer!r} is not installed under {args.peers_dir} "
              f"(no executable {args.peers_dir / PEERS[args.peer][0] / 'serve.sh'}).\n"
              f"Set it up with:\n  {setup_command(args.peer, args.peers_dir)}", file=sys.stderr)
        return 2

    ours = run_prefixgate(settings, args)
    theirs = run_peer(settings, args) if args.peer_name else None
    servers = [s for s in (ours, theirs) if s is not None]
    variant = "tool loop" if settings.tool_loop else "text"
    print_report(f"agent swarm over HTTP ({variant}): {settings.agents} agents x {settings.turns} "
                 f"turns, ~{settings.prompt_tokens}-token shared prompt, "
                 f"{settings.request_max_tokens} output tokens (benchmarks.serving)", servers)

    results: dict[str, Any] = {
        "workload": {**asdict(settings), "variant": variant.replace(" ", "_"),
                     "prompt_token_scale": PROMPT_TOKEN_SCALE, "task_tokens": TASK_TOKENS,
                     "followup_tokens": FOLLOWUP_TOKENS, "arrival": "burst"},
        "peer": args.peer_name,
        **ratios(ours, theirs),
        "servers": {s["name"]: s for s in servers},
    }
    if settings.tool_loop and theirs is not None:
        rejected = theirs["ok"] == 0
        results["peer_tool_loop"] = (f"unsupported, prefixgate-only: {theirs['first_error']}"
                                     if rejected else "ok")
        if rejected:
            print(f"\ntool loop: {args.peer_name} rejected every request, so this variant is "
                  f"prefixgate-only ({theirs['first_error']})")
    print("\n" + "  ".join(f"{k}={_shown(results[k])}" for k in
                           ("peer", "wall_ratio", "ttft_p50_ratio", "ttft_p90_ratio",
                            "output_tokens_per_s_ratio", "rss_tree_ratio")))
    write_json(args.json, results)
    if ours["ok"] == 0 or (theirs is not None and theirs["ok"] == 0 and not settings.tool_loop):
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
