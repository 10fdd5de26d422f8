"""The router's Prometheus metrics: its own decisions and errors, the replicas as it sees them,
and the fleet's prefix-cache counters from Redis (aggregated over every replica).

Fleet counters are read from Redis by the /metrics handler just before rendering (the
collector itself does no I/O); when Redis is down they are simply absent from that scrape.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from prefixgate.cache.stats import HitStats
from prefixgate.gateway.http.metric_labels import StickyLabeler
from prefixgate.gateway.router.fleet import Fleet
from prefixgate.gateway.scaleout.fleet_stats import FleetStats

PREFIX = "prefixgate:"


class FleetCollector(Collector):
    """Per-replica gauges from our view and heartbeats; fleet hit counters from Redis."""

    def __init__(self, fleet: Fleet, redis_up: Callable[[], bool], max_agent_labels: int = 32):
        self.fleet = fleet
        self.redis_up = redis_up
        self.fleet_stats: FleetStats | None = None  # set by the /metrics handler
        # Agents are unbounded: the first ones keep a label, the rest are summed in __other__.
        self.agents = StickyLabeler(max_agent_labels)

    def describe(self) -> Iterator[Metric]:
        return iter(())

    def collect(self) -> Iterator[Metric]:
        up = GaugeMetricFamily(PREFIX + "router_redis_up", "1 when the shared index is reachable.")
        up.add_metric([], 1.0 if self.redis_up() else 0.0)
        yield up
        labels = ["replica", "url"]
        routable = GaugeMetricFamily(PREFIX + "router_replica_routable",
                                     "1 when the router sends traffic to the replica.", labels=labels)
        load = GaugeMetricFamily(PREFIX + "router_replica_load",
                                 "Estimated requests on the replica (running + waiting).", labels=labels)
        inflight = GaugeMetricFamily(PREFIX + "router_replica_inflight",
                                     "Requests this router has in flight on the replica.", labels=labels)
        running = GaugeMetricFamily(PREFIX + "fleet_num_requests_running",
                                    "Running requests, from the replica's heartbeat.", labels=labels)
        waiting = GaugeMetricFamily(PREFIX + "fleet_num_requests_waiting",
                                    "Waiting requests, from the replica's heartbeat.", labels=labels)
        free = GaugeMetricFamily(PREFIX + "fleet_kv_pages_free",
                                 "Allocatable KV pages, from the replica's heartbeat.", labels=labels)
        total = GaugeMetricFamily(PREFIX + "fleet_kv_pages_total",
                                  "KV pages in the replica's pool, from its heartbeat.", labels=labels)
        redis_up = self.redis_up()
        for replica in self.fleet:
            value = [replica.name, replica.url]
            routable.add_metric(value, 1.0 if replica.routable(redis_up) else 0.0)
            load.add_metric(value, replica.load)
            inflight.add_metric(value, replica.inflight)
            beat = replica.heartbeat if replica.heartbeat_fresh else None
            if beat is not None:
                running.add_metric(value, beat.num_running)
                waiting.add_metric(value, beat.num_waiting)
                free.add_metric(value, beat.pages_free)
                total.add_metric(value, beat.num_pages)
        yield from (routable, load, inflight, running, waiting, free, total)
        stats = self.fleet_stats
        if stats is None:
            return
        for scope, per_key in (("replica", _fold(stats.per_replica)),
                               ("tenant", _fold(stats.per_tenant)),
                               ("agent", self.agents.fold(stats.per_agent))):
            queries = CounterMetricFamily(
                f"{PREFIX}fleet_{scope}_prefix_cache_queries",
                f"Prefix cache queries per {scope} over the fleet, in prompt tokens.",
                labels=[scope])
            hits = CounterMetricFamily(
                f"{PREFIX}fleet_{scope}_prefix_cache_hits",
                f"Prefix cache hits per {scope} over the fleet, in prompt tokens.",
                labels=[scope])
            for name, (query_tokens, hit_tokens) in sorted(per_key.items()):
                queries.add_metric([name], query_tokens)
                hits.add_metric([name], hit_tokens)
            yield queries
            yield hits
        fleet_total = stats.total
        queries = CounterMetricFamily(PREFIX + "fleet_prefix_cache_queries",
                                      "Prefix cache queries over the fleet, in prompt tokens.")
        queries.add_metric([], fleet_total.query_tokens)
        hits = CounterMetricFamily(PREFIX + "fleet_prefix_cache_hits",
                                   "Prefix cache hits over the fleet, in prompt tokens.")
        hits.add_metric([], fleet_total.hit_tokens)
        yield queries
        yield hits


def _fold(per_key: Mapping[str, HitStats]) -> dict[str, tuple[int, int]]:
    return {name: (s.query_tokens, s.hit_tokens) for name, s in per_key.items()}


class RouterMetrics:
    """The router's registry."""

    def __init__(self, fleet: Fleet, redis_up: Callable[[], bool]):
        self.registry = CollectorRegistry(auto_describe=False)
        self.decisions = Counter(
            PREFIX + "router_decisions", "Requests placed, by replica and reason.",
            ["replica", "reason"], registry=self.registry)
        self.prompt_tokens = Counter(
            PREFIX + "router_prompt_tokens", "Prompt tokens of placed completion requests.",
            ["replica"], registry=self.registry)
        self.matched_tokens = Counter(
            PREFIX + "router_matched_tokens",
            "Prompt tokens the index said the chosen replica holds (predicted hits).",
            ["replica"], registry=self.registry)
        self.tier_tokens = Counter(
            PREFIX + "router_tier_tokens",
            "Prompt tokens after the matched ones that the chosen replica can load from the "
            "fleet's Redis KV tier (predicted tier hits).",
            ["replica"], registry=self.registry)
        self.retries = Counter(
            PREFIX + "router_retries",
            "Requests re-sent elsewhere after the first replica failed before any byte.",
            ["replica"], registry=self.registry)
        self.upstream_errors = Counter(
            PREFIX + "router_upstream_errors", "Failed upstream exchanges, by replica and kind.",
            ["replica", "kind"], registry=self.registry)
        self.decision_seconds = Histogram(
            PREFIX + "router_decision_seconds",
            "Time to place a request (tokenise, hash, index lookup, score).",
            buckets=(0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0),
            registry=self.registry)
        self.fleet_collector = FleetCollector(fleet, redis_up)
        self.registry.register(self.fleet_collector)

    def render(self, fleet_stats: FleetStats | None) -> bytes:
        self.fleet_collector.fleet_stats = fleet_stats
        return generate_latest(self.registry)
