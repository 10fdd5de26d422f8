"""Ray Serve routing benchmark (#40.2): the agent swarm through prefixgate on Ray Serve, our
prefix-aware request router vs Ray Serve LLM's ``PrefixCacheAffinityRouter`` vs Ray's default
power-of-two-choices router.

Setup: a single-node Ray started in this process (``--ray-cpus`` [2]); per router a fresh
application (gateway/scaleout/ray_serve: one ingress, --replicas [2] replicas of the default
model, each with a KV pool of --pool-fraction [0.5] of the swarm's working set, 1 torch
thread), so every router starts from cold caches and Ray's router from an empty prefix tree.
Ray's router runs as shipped (``imbalanced_threshold`` inf: prefix affinity always wins, the
character match of the prompts it routed itself; ``--affinity-threshold`` sets it).

Workloads (agents.workload, burst arrival, greedy, streamed):
  swarm  --groups [4] agent types x --agents-per-group [2] agents x --turns [3] turns, each
         type with its own ~--system-tokens [600] system prompt (benchmarks.routing's swarm);
  hot    the same agents all sharing ONE system prompt: the case where prefix affinity sends
         everything to the replica that computed it first (--workloads swarm hot).

Measured per (workload, router): achieved hit rate (usage cached_tokens / prompt tokens),
ideal (block-level, an infinite cache seeing requests in send order, agents.ideal) and
achieved/ideal; TTFT p50/p90; requests finished per replica (each replica's own /metrics) and
max load share; wall time; our router's decision reasons.
"""

from __future__ import annotations

import asyncio
import os
import time
from typing import Any

import httpx
from prometheus_client.parser import text_string_to_metric_families

from benchmarks.common import base_parser, free_port, print_table, write_json
from benchmarks.routing import PAGE_SIZE, working_set_pages
from prefixgate.agents.report import summarize
from prefixgate.agents.runner import Endpoint, run_workload
from prefixgate.agents.workload import SwarmConfig, build_workload

ROUTER_NAMES = ("prefix", "prefix_cache_affinity", "pow2")
WORKLOADS = ("swarm", "hot")
APP = "prefixgate"


def replica_urls(ray: Any) -> list[str]:
    """The gateway URL of every running prefixgate replica (from its Ray routing stats)."""
    urls = []
    for actor in ray.util.list_named_actors(all_namespaces=True):
        if "PrefixgateReplica" in actor["name"]:
            handle = ray.get_actor(actor["name"], namespace=actor["namespace"])
            urls.append(ray.get(handle.record_routing_stats.remote())["url"])
    return sorted(urls)


def finished_requests(url: str) -> int:
    """Requests this replica finished (its ``request_success`` counter, every reason)."""
    text = httpx.get(url + "/metrics", timeout=30).text
    return int(sum(sample.value for family in text_string_to_metric_families(text)
                   for sample in family.samples
                   if sample.name.endswith("request_success_total")))


def wait_following(base: str, replicas: int, timeout_s: float = 120) -> None:
    """Our router starts following a replica's KV events once Ray reports its routing stats."""
    httpx.get(base + "/v1/models", timeout=60).raise_for_status()  # builds the handle's router
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        routers = httpx.get(base + "/ray/router", timeout=30).json()["routers"]
        if routers and len(routers[0]["replicas"]) == replicas:
            return
        time.sleep(0.2)
    raise RuntimeError("the prefix router never followed every replica's KV events")


def run_one(ray: Any, serve: Any, base: str, router: str, config: SwarmConfig,
            num_pages: int, args: Any) -> dict[str, Any]:
    from prefixgate.gateway.scaleout.ray_serve.application import (
        RayServeOptions,
        build_application,
    )
    from prefixgate.gateway.scaleout.ray_serve.replica import ReplicaOptions

    kwargs = {"imbalanced_threshold": args.affinity_threshold} \
        if router == "prefix_cache_affinity" and args.affinity_threshold is not None else {}
    options = RayServeOptions(
        num_replicas=args.replicas, router=router, router_kwargs=kwargs,
        replica_num_cpus=args.ray_cpus / (args.replicas + 1),
        replica=ReplicaOptions(engine={"num_pages": num_pages, "page_size": PAGE_SIZE,
                                       "max_waiting": 512}, torch_threads=1))
    serve.run(build_application(options), name=APP, route_prefix="/")
    try:
        if router == "prefix":
            wait_following(base, args.replicas)
        urls = replica_urls(ray)
        before = {url: finished_requests(url) for url in urls}
        result = asyncio.run(run_workload(build_workload(config), Endpoint(router, base),
                                          page_size=PAGE_SIZE, tokenize=True))
        served = {url: finished_requests(url) - before[url] for url in urls}
        reasons = {}
        if router == "prefix":
            reasons = httpx.get(base + "/ray/router", timeout=30).json()["routers"][0]["reasons"]
    finally:
        serve.delete(APP)
    summary = summarize([result])
    total = sum(served.values()) or 1
    return {
        "hit_rate": summary.achieved_hit_rate,
        "ideal_block_hit_rate": summary.ideal_block_hit_rate,
        "achieved_over_ideal": summary.achieved_over_ideal,
        "ttft_p50_s": summary.ttft_s.p50,
        "ttft_p90_s": summary.ttft_s.p90,
        "requests_per_replica": sorted(served.values(), reverse=True),
        "max_load_share": max(served.values()) / total,
        "wall_s": summary.wall_s,
        "errors": summary.requests - summary.ok,
        "reasons": reasons,
    }


def main() -> None:
    parser = base_parser(__doc__.splitlines()[0])
    parser.add_argument("--groups", type=int, default=4)
    parser.add_argument("--agents-per-group", type=int, default=2)
    parser.add_argument("--turns", type=int, default=3)
    parser.add_argument("--system-tokens", type=int, default=600)
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument("--concurrency", type=int, default=4)
    parser.add_argument("--pool-fraction", type=float, default=0.5)
    parser.add_argument("--replicas", type=int, default=2)
    parser.add_argument("--ray-cpus", type=float, default=float(os.cpu_count() or 2))
    parser.add_argument("--routers", nargs="+", default=list(ROUTER_NAMES), choices=ROUTER_NAMES)
    parser.add_argument("--workloads", nargs="+", default=list(WORKLOADS), choices=WORKLOADS)
    parser.add_argument("--affinity-threshold", type=float, default=None,
                        help="PrefixCacheAffinityRouter's imbalanced_threshold (default: Ray's)")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()

    import ray
    from ray import serve

    from prefixgate.engine.loader.tokenizer_only import load_tokenizer_only

    tokenizer = load_tokenizer_only(None).tokenizer
    swarm = SwarmConfig(groups=args.groups, agents_per_group=args.agents_per_group,
                        turns=args.turns, system_tokens=args.system_tokens,
                        max_tokens=args.max_tokens, concurrency=args.concurrency,
                        temperature=0.0, seed=args.seed, task_tokens=64, followup_tokens=48)
    hot = SwarmConfig(**{**swarm.to_dict(), "groups": 1,
                         "agents_per_group": args.groups * args.agents_per_group})
    working_set = working_set_pages(swarm, tokenizer)
    num_pages = max(64, round(args.pool_fraction * working_set))
    port = free_port()
    ray.init(num_cpus=args.ray_cpus, include_dashboard=False, log_to_driver=False)
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    base = f"http://127.0.0.1:{port}"
    figures: dict[str, dict[str, Any]] = {}
    results: dict[str, Any] = {
        "workload": swarm.to_dict(), "num_requests": build_workload(swarm).num_requests,
        "num_pages_per_replica": num_pages, "working_set_pages": working_set,
        "page_size": PAGE_SIZE, "replicas": args.replicas, "ray_cpus": args.ray_cpus,
        "runs": figures,
    }
    try:
        for workload in args.workloads:
            config = swarm if workload == "swarm" else hot
            for router in args.routers:
                print(f"running {workload} / {router} ...", flush=True)
                figures[f"{workload}_{router}"] = {
                    **run_one(ray, serve, base, router, config, num_pages, args),
                    "load_average_1m": os.getloadavg()[0]}
                write_json(args.json, results)  # a long run keeps what it measured
    finally:
        serve.shutdown()
        ray.shutdown()
    rows = [(f"{run}: {key}", value) for run, row in figures.items()
            for key, value in row.items() if key not in ("reasons",)]
    print_table(f"ray_routing: {args.replicas} replicas, {results['num_requests']} requests "
                "per run", rows)
    write_json(args.json, results)


if __name__ == "__main__":
    main()
