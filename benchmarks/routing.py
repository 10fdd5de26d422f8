"""Routing benchmark: cache-aware vs round-robin vs random placement over two replicas.

Setup (one process, loopback): a ``redis-server`` subprocess (the shared prefix index); two
prefixgate replicas (uvicorn, one loaded SmolLM2-135M shared, each with its own engine and a
KV pool of --num-pages pages) publishing their block hashes and load to it; for each policy a
fresh router in front of them. Before each policy every replica's cache is reset, so the three
runs replay the same workload (same seed, greedy decoding) from cold caches.

Workload (agents.workload, deterministic; defaults in brackets): --groups [4] agent types with
distinct system prompts (role, rules, JSON tool schemas: --system-tokens [1000] approximate
tokens, ~980 real), --agents-per-group [4] agents each, --turns [3] turns per agent; each turn
re-sends the whole conversation (+ the reply of --max-tokens [16], + a tool result or follow-up
of --followup-tokens [48]); the opening task is --task-tokens [64]. All agents arrive at once;
--concurrency [8] requests in flight at most. 48 requests per policy by default.

KV pool: each replica gets --pool-fraction [0.5] of the swarm's working set (every agent's
final conversation in pages, each system prompt counted once; --num-pages overrides): the two
replicas together hold the swarm, one alone does not. A policy that keeps each agent type on
one replica keeps its prefixes cached; one that sprays requests makes every replica hold every
system prompt and conversation, and evicts. That is where placement decides the hit rate of a
fleet running at capacity.

--workload hot: the same agents behind ONE system prompt (groups = 1, agents = groups x
agents-per-group): the worst case of prefix affinity, where every request matches the replica
that computed the shared prompt first. --workload trace: a Mooncake-format trace replayed over
HTTP as benchmarks.trace replays it (its flags: --trace, --mode, --sessions, --quick, ...), the
pool --pool-fraction of the trace's working set (distinct blocks + outputs).

Policies: cache_aware (ours, Redis index), round_robin, random, dynamo (NVIDIA Dynamo's
SelectionService fed by the replicas' KV events, benchmarks/dynamo_router.py; --dynamo-env
DYN_...=V sets its KvRouterConfig through Dynamo's variables). For dynamo the run also reports
dynamo_overlap_seen (requests whose prefix Dynamo's index found on some replica) and
dynamo_best_overlap_chosen (of those, the share placed on the replica with the longest overlap):
a hashing mismatch shows as the first near 0, a cost function that outweighs overlap with load
as the second near 1/2.

Measured per policy, in one run:
  hit_rate        sum(usage cached_tokens) / sum(usage prompt_tokens) over all requests
  prefill_tokens  prompt tokens the replicas actually computed (engine counters, both replicas)
  max_load_share  the largest fraction of requests placed on one replica
  wall_s, ttft_p50_s, errors, and the cache-aware router's decision reasons.
Goal: hit_rate_cache_aware >= hit_rate_round_robin + 0.20 and max_load_share_cache_aware <= 0.65.
"""

from __future__ import annotations

import asyncio
import os
import shutil
import statistics
import subprocess
import time
from collections import Counter
from typing import Any, NamedTuple

import httpx
import redis
import torch

from benchmarks.common import base_parser, free_port, print_table, write_json
from prefixgate.agents.runner import Endpoint, RunResult, run_workload
from prefixgate.agents.workload import SwarmConfig, build_workload
from prefixgate.engine.async_engine import AsyncEngine
from prefixgate.engine.build import create_llm_engine
from prefixgate.engine.config import EngineConfig
from prefixgate.engine.loader import load_model
from prefixgate.gateway.router.app import create_router_app
from prefixgate.gateway.router.launch import router_server
from prefixgate.gateway.router.settings import RouterSettings
from prefixgate.gateway.scaleout.kv_events.config import parse_kv_events_config
from prefixgate.gateway.server import ServerSettings, create_app
from prefixgate.gateway.server.launch import GatewayServer, ServersThread, uvicorn_config

POLICIES = ("cache_aware", "round_robin", "random", "dynamo")
DEFAULT_POLICIES = ("cache_aware", "round_robin", "random")
# replicas publish KV events for the dynamo policy (its SelectionService subscribes)
KV_EVENTS = ('{"enable_kv_cache_events": true, "endpoint": "tcp://127.0.0.1:*", '
             '"replay_endpoint": "tcp://127.0.0.1:*"}')
PAGE_SIZE = 16



def wait_until(predicate, timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() > deadline:
            raise RuntimeError(f"timed out waiting for {what}")
        time.sleep(0.05)


def start_redis() -> tuple[subprocess.Popen, str]:
    binary = shutil.which("redis-server") or "/usr/bin/redis-server"
    if not os.path.exists(binary):
        raise SystemExit("redis-server is not installed (apt-get install redis-server)")
    port = free_port()
    process = subprocess.Popen([binary, "--port", str(port), "--bind", "127.0.0.1", "--save", "",
                                "--appendonly", "no", "--loglevel", "warning"],
                               stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    client = redis.Redis(port=port, socket_timeout=1)

    def up() -> bool:
        try:
            return bool(client.ping())
        except redis.RedisError:
            return False

    wait_until(up, 20, "redis-server")
    return process, f"redis://127.0.0.1:{port}/0"


class _Decision(NamedTuple):
    replica: str
    reason: str


def working_set_pages(config: SwarmConfig, tokenizer: Any) -> int:
    """Pages to hold every agent's final conversation (replies stood in for by max_tokens
    tokens of filler), each group's system prompt once."""
    total = 0
    systems = set()
    filler = " ".join(["word"] * config.max_tokens)
    for agent in build_workload(config).agents:
        messages = agent.messages([filler] * (agent.turns - 1))
        tokens = tokenizer.apply_chat_template(messages)
        system = len(tokenizer.apply_chat_template(messages[:1], add_generation_prompt=False))
        total += -(-(len(tokens) + config.max_tokens) // PAGE_SIZE)
        if agent.group in systems:
            total -= system // PAGE_SIZE  # shared with the group's first agent
        systems.add(agent.group)
    return total


def prefill_computed(engines: list[AsyncEngine]) -> int:
    return sum(e.engine_stats().prefill_tokens_computed for e in engines)


def dynamo_server(servers: list[GatewayServer], tokenizer: Any, model_id: str) -> Any:
    """A front door placing requests with Dynamo's selection fed by the replicas' KV events."""
    import uvicorn

    from benchmarks.dynamo_router import DynamoWorker, create_dynamo_router_app
    from prefixgate.gateway.http.bound_server import BoundServer

    workers = [DynamoWorker(s.base_url, s.config.app.state.kv_events.endpoint,
                            s.config.app.state.kv_events.replay_endpoint) for s in servers]
    served = servers[0].config.app.state.server.model_name
    app = create_dynamo_router_app(workers, tokenizer=tokenizer, model_id=model_id,
                                   served_model=served, page_size=PAGE_SIZE)
    return BoundServer(uvicorn.Config(app, host="127.0.0.1", port=free_port(),
                                      log_level="warning", lifespan="on"))


def open_front(policy: str, urls: list[str], redis_url: str, tokenizer: Any, model_id: str,
               seed: int, replica_servers: list[GatewayServer],
               router_overrides: dict[str, Any] | None = None) -> tuple[Any, Any]:
    """(the front door's server, our router's state or None) for one policy."""
    if policy == "dynamo":
        return dynamo_server(replica_servers, tokenizer, model_id), None
    settings = RouterSettings(replicas=tuple(urls), redis_url=redis_url, port=0, policy=policy,
                              page_size=PAGE_SIZE, log_level="warning", seed=seed,
                              **(router_overrides or {}))
    app = create_router_app(settings, tokenizer=tokenizer, model_id=model_id)
    return router_server(settings, app), app.state.router


def run_load(base_url: str, label: str, config: SwarmConfig | None,
             replay: list[Any] | None, mode: str) -> dict[str, Any]:
    """Send the swarm (``config``) or the trace (``replay``) through ``base_url``."""
    if replay is not None:
        from benchmarks.trace import replay_requests, summarise

        wall_s, outcomes = asyncio.run(replay_requests(base_url, None, replay, mode))
        figures = summarise(outcomes, wall_s)
        return {key: figures[key] for key in ("hit_rate", "prompt_tokens", "wall_s",
                                              "ttft_p50_s", "ttft_p90_s", "errors")}
    result: RunResult = asyncio.run(run_workload(
        build_workload(config), Endpoint(label, base_url), page_size=PAGE_SIZE, tokenize=False))
    ok = [r for r in result.records if r.ok]
    prompt = sum(r.prompt_tokens or 0 for r in ok)
    cached = sum(r.cached_tokens or 0 for r in ok)
    ttfts = sorted(r.ttft_s for r in ok if r.ttft_s is not None)
    return {
        "hit_rate": cached / prompt if prompt else 0.0,
        "prompt_tokens": prompt,
        "wall_s": result.wall_s,
        "ttft_p50_s": statistics.median(ttfts) if ttfts else None,
        "ttft_p90_s": ttfts[min(len(ttfts) - 1, int(0.9 * len(ttfts)))] if ttfts else None,
        "errors": len(result.records) - len(ok),
    }


def dynamo_figures(app: Any) -> dict[str, Any]:
    """Whether Dynamo saw each prompt's prefix somewhere, and whether it placed by it."""
    overlaps = app.state.overlaps
    seen = [(best, chosen) for best, chosen in overlaps if best > 0]
    return {"dynamo_overlap_seen": len(seen) / len(overlaps) if overlaps else None,
            "dynamo_best_overlap_chosen": (sum(chosen == best for best, chosen in seen)
                                           / len(seen)) if seen else None}


def run_policy(policy: str, urls: list[str], redis_url: str, engines: list[AsyncEngine],
               tokenizer: Any, model_id: str, config: SwarmConfig | None,
               replica_servers: list[GatewayServer], replay: list[Any] | None = None,
               mode: str = "closed", router_overrides: dict[str, Any] | None = None
               ) -> dict[str, Any]:
    with httpx.Client(timeout=120) as client:
        for url in urls:
            client.post(url + "/v1/cache/reset").raise_for_status()
    seed = config.seed if config is not None else 0
    server, router = open_front(policy, urls, redis_url, tokenizer, model_id, seed,
                                replica_servers, router_overrides)
    thread = ServersThread([server], [])
    thread.start_and_wait()
    extra: dict[str, Any] = {}
    try:
        if router is not None:
            wait_until(lambda: all(r.heartbeat_fresh for r in router.fleet), 30, "heartbeats")
        before = prefill_computed(engines)
        figures = run_load(server.base_url, policy, config, replay, mode)
        for engine in engines:
            engine.wait_idle(60)
        figures["prefill_tokens"] = prefill_computed(engines) - before
        if router is None:
            app = server.config.app
            decisions = [_Decision(urls[i], "dynamo") for i in app.state.decisions]
            extra = dynamo_figures(app)
        else:
            decisions = list(router.decisions)
    finally:
        thread.stop()
    shares = Counter(d.replica for d in decisions)
    figures.update({
        "max_load_share": max(shares.values()) / len(decisions),
        "requests_per_replica": dict(sorted(shares.items())),
        "reasons": dict(sorted(Counter(d.reason for d in decisions).items())),
        **extra,
    })
    return figures


def trace_pages(replay: list[Any], pool_fraction: float) -> tuple[int, int]:
    """(KV pages per replica, the trace's working set in pages incl. outputs)."""
    from benchmarks.trace_workload import describe

    shape = describe(replay, PAGE_SIZE)
    working_set = -(-(shape["working_set_tokens"] + shape["output_tokens"]) // PAGE_SIZE)
    return max(64, round(pool_fraction * working_set)), working_set


def parse_args() -> Any:
    parser = base_parser(__doc__.splitlines()[0])
    parser.add_argument("--workload", choices=("swarm", "hot", "trace"), default="swarm",
                        help="swarm: the agent swarm; hot: the same agents sharing ONE system "
                        "prompt; trace: a Mooncake-format trace replay (benchmarks.trace flags)")
    parser.add_argument("--groups", type=int, default=4)
    parser.add_argument("--agents-per-group", type=int, default=4)
    parser.add_argument("--turns", type=int, default=3)
    parser.add_argument("--system-tokens", type=int, default=1000)
    parser.add_argument("--task-tokens", type=int, default=64)
    parser.add_argument("--followup-tokens", type=int, default=48)
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--pool-fraction", type=float, default=0.5,
                        help="KV pages per replica, as a fraction of the workload's working set")
    parser.add_argument("--num-pages", type=int, default=None, help="KV pages per replica "
                        "(overrides --pool-fraction)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--torch-threads", type=int, default=max(1, (os.cpu_count() or 2) // 2),
                        help="intra-op threads (two engines share this process)")
    parser.add_argument("--policies", nargs="+", default=list(DEFAULT_POLICIES), choices=POLICIES,
                        help="dynamo: NVIDIA Dynamo's SelectionService fed by the replicas' KV "
                        "events (needs ai-dynamo-runtime)")
    parser.add_argument("--balance-abs-threshold", type=int, default=None, metavar="N",
                        help="our router's load guard (prefixgate route's flag; default its own)")
    parser.add_argument("--dynamo-env", nargs="*", default=[], metavar="DYN_X=VALUE",
                        help="Dynamo KvRouterConfig overrides through its DYN_* variables, e.g. "
                        "DYN_ROUTER_PREFILL_LOAD_SCALE=4")
    from benchmarks.trace import add_workload_arguments

    add_workload_arguments(parser)
    return parser.parse_args()


def start_replicas(num_pages: int, loaded: Any, redis_url: str
                   ) -> tuple[list[AsyncEngine], list[GatewayServer], list[str], dict[str, Any]]:
    """Two replicas in this process (one loaded model, an engine and pool each)."""
    engines, servers, urls = [], [], []
    for index in range(2):
        core, info = create_llm_engine(EngineConfig(num_pages=num_pages, page_size=PAGE_SIZE,
                                                    max_waiting=512), loaded=loaded)
        engine = AsyncEngine(core, model_name=info["model_name"], device=info["device"],
                             kernel_backend=info["kernel_backend"])
        port = free_port()
        settings = ServerSettings(host="127.0.0.1", port=port, log_level="warning",
                                  redis_url=redis_url, replica_id=f"replica-{'ab'[index]}",
                                  advertise_url=f"http://127.0.0.1:{port}",
                                  kv_events=parse_kv_events_config(KV_EVENTS))
        app = create_app(engine, settings, manage_engine=False)
        servers.append(GatewayServer(uvicorn_config(app, settings), engine, settings))
        engines.append(engine)
        urls.append(f"http://127.0.0.1:{port}")
    return engines, servers, urls, info


def main() -> None:
    args = parse_args()
    torch.set_num_threads(args.torch_threads)
    for assignment in args.dynamo_env:
        name, _, value = assignment.partition("=")
        os.environ[name] = value
    config = SwarmConfig(groups=args.groups, agents_per_group=args.agents_per_group,
                         turns=args.turns, system_tokens=args.system_tokens,
                         task_tokens=args.task_tokens, followup_tokens=args.followup_tokens,
                         max_tokens=args.max_tokens, concurrency=args.concurrency,
                         temperature=0.0, seed=args.seed)
    if args.workload == "hot":  # every agent behind one system prompt
        config = SwarmConfig(**{**config.to_dict(), "groups": 1,
                                "agents_per_group": args.groups * args.agents_per_group})
    loaded = load_model(None)
    replay, shape = None, {}
    if args.workload == "trace":
        from benchmarks.trace import build_from_args

        replay, shape = build_from_args(args)
        pages, working_set = trace_pages(replay, args.pool_fraction)
        config = None
    else:
        working_set = working_set_pages(config, loaded.tokenizer)
        pages = max(64, round(args.pool_fraction * working_set))
    num_pages = args.num_pages or pages
    overrides = {} if args.balance_abs_threshold is None \
        else {"balance_abs_threshold": args.balance_abs_threshold}
    redis_process, redis_url = start_redis()
    engines, servers, urls, info = start_replicas(num_pages, loaded, redis_url)
    thread = ServersThread(servers, engines)
    thread.start_and_wait()
    per_policy: dict[str, dict[str, Any]] = {}
    try:
        for policy in args.policies:
            print(f"running {policy} ...", flush=True)
            per_policy[policy] = run_policy(
                policy, urls, redis_url, engines, loaded.tokenizer, loaded.name, config, servers,
                replay, args.mode, overrides)
    finally:
        thread.stop()
        redis_process.kill()
    report(args, config, shape, per_policy, num_pages, working_set, info)


def report(args: Any, config: SwarmConfig | None, shape: dict[str, Any],
           per_policy: dict[str, dict[str, Any]], num_pages: int, working_set: int,
           info: dict[str, Any]) -> None:
    results: dict[str, Any] = {
        "workload_kind": args.workload,
        "workload": config.to_dict() if config is not None else shape,
        "num_requests": build_workload(config).num_requests if config is not None
        else shape["requests"],
        "num_pages_per_replica": num_pages, "working_set_pages": working_set,
        "page_size": PAGE_SIZE, "replicas": 2, "torch_threads": args.torch_threads,
        "device": info["device"], "dynamo_env": args.dynamo_env,
        "balance_abs_threshold": args.balance_abs_threshold,
        "load_average": os.getloadavg(),
    }
    for policy, figures in per_policy.items():
        for key, value in figures.items():
            results[f"{key}_{policy}"] = value
    if {"cache_aware", "round_robin"} <= per_policy.keys():
        results["hit_rate_gain_vs_round_robin"] = (per_policy["cache_aware"]["hit_rate"]
                                                   - per_policy["round_robin"]["hit_rate"])
        results["goal_met"] = bool(results["hit_rate_gain_vs_round_robin"] >= 0.20
                                   and per_policy["cache_aware"]["max_load_share"] <= 0.65)
    rows = []
    for key in ("hit_rate", "prefill_tokens", "max_load_share", "wall_s", "ttft_p50_s",
                "ttft_p90_s", "errors", "dynamo_overlap_seen", "dynamo_best_overlap_chosen"):
        rows += [(f"{key}_{policy}", figures[key]) for policy, figures in per_policy.items()
                 if key in figures]
    rows += [(k, results[k]) for k in ("hit_rate_gain_vs_round_robin", "goal_met")
             if k in results]
    print_table(f"routing (benchmarks.routing, {args.workload}): 2 replicas, "
                f"{results['num_requests']} requests per policy", rows)
    write_json(args.json, results)


if __name__ == "__main__":
    main()
