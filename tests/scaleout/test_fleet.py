"""The fleet end to end: an agent swarm through the router over two replicas publishing to a
real Redis; then Redis killed mid-run; then a replica killed mid-run.

Workloads are tiny (short prompts, 3 output tokens) because every token runs on the CPU.
"""

from __future__ import annotations

import asyncio
import time
from collections import Counter
from dataclasses import replace

import httpx
import pytest

from prefixgate.agents.runner import Endpoint, RunResult, run_workload
from prefixgate.agents.workload import SwarmConfig, build_workload
from prefixgate.gateway.router.policy import Candidate
from prefixgate.gateway.scaleout.fleet_stats import read_fleet_stats
from prefixgate.gateway.scaleout.keys import RedisKeys
from prefixgate.gateway.scaleout.redis_client import connect
from tests.scaleout.conftest import (
    HEARTBEAT_TTL_S,
    free_port,
    index_mismatch,
    kill_process,
    reset_caches,
    router_settings,
    running_router,
    spawn_replica,
    wait_for,
)

pytestmark = pytest.mark.slow

# 4 groups (4 distinct system prompts) x 2 agents x 3 turns = 24 requests per run.
WORKLOAD = SwarmConfig(groups=4, agents_per_group=2, turns=3, system_tokens=128, task_tokens=24,
                       followup_tokens=16, max_tokens=3, concurrency=4, seed=11)
KEYS = RedisKeys()


def run(url: str, config: SwarmConfig, on_done=None) -> RunResult:
    return asyncio.run(run_workload(build_workload(config), Endpoint("t", url), page_size=16,
                                    tokenize=False, on_request_done=on_done))


def hit_rate(result: RunResult) -> float:
    prompt = sum(r.prompt_tokens or 0 for r in result.records)
    cached = sum(r.cached_tokens or 0 for r in result.records)
    return cached / prompt


def errors(result: RunResult) -> list[str]:
    return [f"{r.agent_id} turn {r.turn}: {r.error_kind} {r.error}" for r in result.records
            if not r.ok]


async def fleet_stats(url: str):
    redis = connect(url)
    try:
        return await read_fleet_stats(redis, KEYS)
    finally:
        await redis.aclose()


def test_fleet_hit_rate_matches_one_replica_and_load_stays_balanced(fleet):
    urls = [r.url for r in fleet.replicas]
    reset_caches(urls)
    single = run(urls[0], WORKLOAD)
    assert not errors(single)
    reset_caches(urls)
    # The router saw replica-a busy with the direct run: start once its view has settled.
    wait_for(lambda: all(r.load == 0 for r in fleet.router.fleet), 30, "idle replicas")
    first = len(fleet.router.decisions)
    routed = run(fleet.router_url, WORKLOAD)
    assert not errors(routed)
    decisions = list(fleet.router.decisions)[first:]
    assert len(decisions) == len(routed.records)

    # The fleet reuses the cache as well as one replica holding everything.
    assert hit_rate(routed) >= hit_rate(single) - 0.05, (hit_rate(routed), hit_rate(single))
    # No replica got more than its share allows, and no placement ignored the load guard.
    shares = Counter(d.url for d in decisions)
    assert max(shares.values()) / len(decisions) <= 0.65, shares
    policy = fleet.router.policy
    for d in decisions:
        chosen = Candidate(d.url, d.matched_tokens, d.loads[d.url])
        assert not policy.overloaded(chosen, min(d.loads.values())), d
    # Affinity did the work: later turns of an agent found their prefix where they were sent.
    later = [d for d in decisions if d.matched_tokens > 0]
    assert len(later) >= len(decisions) // 2, Counter(d.reason for d in decisions)
    # An agent's turns stay with one replica (its conversation is cached there).
    homes: dict[str, set[str]] = {}
    for d in decisions:
        homes.setdefault(d.session, set()).add(d.url)
    assert sum(len(h) == 1 for h in homes.values()) >= len(homes) - 1, homes

    # The fleet's stats, aggregated in Redis, count every routed request.
    def stats_caught_up():
        body = httpx.get(fleet.router_url + "/v1/cache/stats", timeout=30).json()
        agents = body["per_agent"]
        return body if all(a.agent_id in agents for a in build_workload(WORKLOAD).agents) else None

    body = wait_for(stats_caught_up, 30, "fleet stats in Redis")
    assert body["source"] == "redis"
    assert set(body["per_replica"]) >= {r.replica_id for r in fleet.replicas}


def test_redis_outage_fails_no_request_and_the_index_resyncs(fleet):
    reset_caches([r.url for r in fleet.replicas])
    config = replace(WORKLOAD, seed=12)
    resyncs_before = [r.publisher.status.resyncs for r in fleet.replicas]
    first = len(fleet.router.decisions)

    async def main() -> RunResult:
        done = 0
        half = asyncio.Event()

        def on_done(_record) -> None:
            nonlocal done
            done += 1
            if done == 6:
                half.set()

        task = asyncio.create_task(run_workload(build_workload(config),
                                                Endpoint("t", fleet.router_url), page_size=16,
                                                tokenize=False, on_request_done=on_done))
        await half.wait()
        fleet.redis.kill()
        # Keep Redis down until the router has placed requests without it.
        deadline = time.monotonic() + 60
        while (not any(d.reason == "redis_down" for d in list(fleet.router.decisions)[first:])
               and not task.done() and time.monotonic() < deadline):
            await asyncio.sleep(0.05)
        fleet.redis.start()  # empty: no persistence
        return await task

    result = asyncio.run(main())
    assert not errors(result)
    reasons = Counter(d.reason for d in list(fleet.router.decisions)[first:])
    assert reasons["redis_down"] > 0, reasons
    # Both replicas republish their whole index into the fresh Redis, by themselves.
    client = fleet.redis.client()
    for replica in fleet.replicas:
        wait_for(lambda r=replica: not index_mismatch(client, r), 60,
                 f"{replica.replica_id}'s index to resync",
                 explain=lambda r=replica: index_mismatch(client, r))
    client.close()
    assert [r.publisher.status.resyncs for r in fleet.replicas] > resyncs_before
    # The fleet counters the restart wiped are written again, without double counting.
    def counters_back() -> bool:
        stats = asyncio.run(fleet_stats(fleet.redis.url))
        return all(stats.per_replica.get(r.replica_id) == r.engine.cache_stats().total
                   for r in fleet.replicas)

    wait_for(counters_back, 30, "the fleet counters to be re-written")
    # ... and the router routes by the index again.
    wait_for(lambda: fleet.router.redis_up and all(r.heartbeat_fresh for r in fleet.router.fleet),
             30, "the router to see Redis and both heartbeats again")
    messages = build_workload(config).agents[0].messages([])
    response = httpx.post(fleet.router_url + "/v1/chat/completions", timeout=120,
                          json={"messages": messages, "max_tokens": 1, "temperature": 0})
    assert response.status_code == 200
    assert response.headers["x-prefixgate-route"] in ("prefix", "load", "session", "hash")
    assert fleet.router.decisions[-1].matched_tokens > 0


def test_a_crashed_replica_loses_no_unstarted_request(fleet):
    port = free_port()
    process = spawn_replica(fleet.redis.url, "replica-c", port)
    crashed_url = f"http://127.0.0.1:{port}"
    try:
        def healthy() -> bool:
            if process.poll() is not None:
                raise AssertionError(f"replica-c exited: {process.stderr.read().decode()[-2000:]}")
            try:
                return httpx.get(crashed_url + "/health", timeout=2).status_code == 200
            except httpx.HTTPError:
                return False

        wait_for(healthy, 240, "the replica subprocess to serve", interval_s=0.5)
        urls = [r.url for r in fleet.replicas] + [crashed_url]
        reset_caches(urls)
        settings = router_settings(urls, fleet.redis.url)
        with running_router(settings, fleet.tokenizer, fleet.model_id) as (url, app):
            router = app.state.router
            wait_for(lambda: all(r.heartbeat_fresh for r in router.fleet), 30,
                     "three fresh heartbeats")
            config = replace(WORKLOAD, seed=13, groups=6, agents_per_group=1)
            killed_at: list[float] = []
            in_flight: list[int] = []  # requests the crashed replica held when it died

            async def main() -> RunResult:
                task = asyncio.create_task(run_workload(build_workload(config),
                                                        Endpoint("t", url), page_size=16,
                                                        tokenize=False))
                # Crash it while it holds requests (the router thread updates the count).
                victim = router.fleet.get(crashed_url)
                while victim.inflight == 0 and not task.done():
                    await asyncio.sleep(0.01)
                in_flight.append(victim.inflight)
                kill_process(process)  # SIGKILL: no goodbye, the index and heartbeat stay
                killed_at.append(time.monotonic())
                return await task

            result = asyncio.run(main())
            decisions = list(router.decisions)
        # Only a request the crashed replica had started streaming may fail.
        lost = [r for r in result.records if not r.ok]
        assert all(r.status == 200 for r in lost), errors(result)
        assert len(lost) < len(result.records) // 4, errors(result)
        # Every request it held was either re-sent elsewhere or had started streaming.
        retried = [d for d in decisions if d.reason == "retry"]
        assert len(retried) + len(lost) >= in_flight[0], (in_flight, retried, lost)
        print(f"crash: {in_flight[0]} in flight, {len(retried)} retried, {len(lost)} lost "
              f"mid-stream")
        # Its traffic moved within the heartbeat TTL (a refused connection moves it at once).
        late = [d for d in decisions if d.url == crashed_url
                and d.at > killed_at[0] + HEARTBEAT_TTL_S]
        assert not late, late
        assert any(d.at > killed_at[0] for d in decisions), "no request was placed after the crash"
        # The janitor removes what the dead replica left in the index.
        client = fleet.redis.client()
        try:
            wait_for(lambda: not client.exists(KEYS.replica_blocks("replica-c"))
                     and b"replica-c" not in client.smembers(KEYS.replicas), 30,
                     "the janitor to reap replica-c")
        finally:
            client.close()
    finally:
        kill_process(process)
