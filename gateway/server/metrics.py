"""Prometheus metrics on the server's own registry, named like vLLM's (``prefixgate:`` for ``vllm:``).

Two sources:

* request timings and token counts, observed by the gateway as deltas stream out
  (:class:`RequestTimer`);
* cache and scheduler state, read from the engine's snapshot at scrape time
  (:class:`EngineCollector`), so there is one source of truth for hits and pages.

Per-agent label values are BOUNDED: the first ``max_agent_labels`` agents seen (the busiest
first when several appear in one scrape) keep their own label for the life of the process; every
later agent is summed into ``__other__``. The decision is sticky so every series stays monotonic.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Iterator, Mapping

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from prefixgate.cache.stats import CacheStats, HitStats
from prefixgate.cache.ttl_policy import RecomputeCost
from prefixgate.engine.api import Delta, EngineLike, EngineStats, Usage
from prefixgate.gateway.http.metric_labels import StickyLabeler

PREFIX = "prefixgate:"
VLLM_PREFIX = "vllm:"  # the few series named as vLLM names them, for external routers

_TTFT_BUCKETS = (
    0.001,
    0.005,
    0.01,
    0.02,
    0.04,
    0.06,
    0.08,
    0.1,
    0.25,
    0.5,
    0.75,
    1.0,
    2.5,
    5.0,
    7.5,
    10.0,
    20.0,
    40.0,
    80.0,
    160.0,
    640.0,
)
_ITL_BUCKETS = (
    0.001,
    0.005,
    0.01,
    0.025,
    0.05,
    0.075,
    0.1,
    0.15,
    0.2,
    0.3,
    0.4,
    0.5,
    0.75,
    1.0,
    2.5,
    5.0,
    7.5,
    10.0,
    20.0,
    40.0,
    80.0,
)
_E2E_BUCKETS = (
    0.1,
    0.3,
    0.5,
    0.8,
    1.0,
    1.5,
    2.0,
    2.5,
    5.0,
    10.0,
    15.0,
    20.0,
    30.0,
    40.0,
    50.0,
    60.0,
    120.0,
    240.0,
    480.0,
    960.0,
    1920.0,
    7680.0,
)


class EngineCollector(Collector):
    """Reads ``engine.cache_stats()`` / ``engine.engine_stats()`` at each scrape."""

    def __init__(self, engine: EngineLike, model_name: str, max_agent_labels: int):
        self.engine = engine
        self.model_name = model_name
        self.agents = StickyLabeler(max_agent_labels)
        # Tenants are bounded by the key table already; the cap only guards a misconfiguration.
        self.tenants = StickyLabeler(max(64, max_agent_labels))

    def describe(self) -> Iterator[Metric]:
        return iter(())  # families are only known at collect time

    def collect(self) -> Iterator[Metric]:
        cache = self.engine.cache_stats()
        engine = self.engine.engine_stats()
        yield from self._snapshot(_SNAPSHOT_METRICS[:_PAGES_AT], cache, engine)
        yield self._pages(cache)
        yield from self._snapshot(_SNAPSHOT_METRICS[_PAGES_AT:], cache, engine)
        if engine.tier is not None:
            yield from tier_metrics(engine.tier, self._counter, self._gauge)
        yield from self._per_key("tenant", self.tenants, cache.per_tenant)
        yield from self._per_key("agent", self.agents, cache.per_agent)
        yield self._retained_per_tenant(cache)
        yield from self._vllm_names(cache, engine)

    def _vllm_names(self, cache: CacheStats, engine: EngineStats) -> Iterator[Metric]:
        """The vLLM-named series external routers read (llm-d's Endpoint Picker, Dynamo):
        the same values as ours, under ``vllm:`` (docs/fleet.md)."""
        for name, doc, value in (
                ("num_requests_waiting", "Requests waiting to be scheduled.", engine.num_waiting),
                ("num_requests_running", "Requests in the running batch.", engine.num_running),
                ("kv_cache_usage_perc", "KV-cache usage (1 = 100 percent).", cache.usage)):
            family = GaugeMetricFamily(VLLM_PREFIX + name, doc, labels=["model_name"])
            family.add_metric([self.model_name], value)
            yield family
        info = GaugeMetricFamily(VLLM_PREFIX + "cache_config_info", "Information of the cache "
                                 "configuration (vLLM's names).",
                                 labels=["block_size", "num_gpu_blocks"])
        info.add_metric([str(cache.page_size), str(cache.num_pages)], 1)
        yield info

    def _counter(self, name: str, doc: str, value: float) -> CounterMetricFamily:
        family = CounterMetricFamily(PREFIX + name, doc, labels=["model_name"])
        family.add_metric([self.model_name], value)
        return family

    def _gauge(self, name: str, doc: str, value: float) -> GaugeMetricFamily:
        family = GaugeMetricFamily(PREFIX + name, doc, labels=["model_name"])
        family.add_metric([self.model_name], value)
        return family

    def _snapshot(self, table: Iterable[_SnapshotMetric], cache: CacheStats,
                  engine: EngineStats) -> Iterator[Metric]:
        for kind, name, doc, value in table:
            make = self._counter if kind == "counter" else self._gauge
            yield make(name, doc, value(cache, engine))

    def _pages(self, cache: CacheStats) -> Metric:
        pages = GaugeMetricFamily(
            PREFIX + "kv_pages",
            "KV pages by state (used + cached_free + free = total).",
            labels=["model_name", "state"],
        )
        pages.add_metric([self.model_name, "used"], cache.pages_used)
        pages.add_metric([self.model_name, "cached_free"], cache.pages_cached_free)
        pages.add_metric([self.model_name, "free"], cache.pages_free)
        return pages

    def _labelled(self, family: type[CounterMetricFamily] | type[GaugeMetricFamily], name: str,
                  doc: str, what: str, values: Mapping[str, float]) -> Metric:
        metric = family(PREFIX + name, doc, labels=["model_name", what])
        for label, value in sorted(values.items()):
            metric.add_metric([self.model_name, label], value)
        return metric

    def _per_key(self, what: str, labeler: StickyLabeler,
                 per_key: Mapping[str, HitStats]) -> Iterator[Metric]:
        """Hits per tenant or agent, on the labeler's bounded labels."""
        folded = labeler.fold(per_key)
        yield self._labelled(CounterMetricFamily, f"{what}_prefix_cache_queries",
                             f"Prefix cache queries per {what}, in prompt tokens.", what,
                             {label: q for label, (q, _) in folded.items()})
        yield self._labelled(CounterMetricFamily, f"{what}_prefix_cache_hits",
                             f"Prefix cache hits per {what}, in prompt tokens.", what,
                             {label: h for label, (_, h) in folded.items()})
        kept: dict[str, int] = {}  # the same labels (fold admitted them) as the hits above
        for key, stats in per_key.items():
            label = labeler.label(key)
            kept[label] = kept.get(label, 0) + stats.retention_hit_tokens
        yield self._labelled(CounterMetricFamily, f"{what}_prefix_cache_retention_hits",
                             f"Prefix cache hits on retained pages per {what}, in prompt tokens.",
                             what, kept)

    def _retained_per_tenant(self, cache: CacheStats) -> Metric:
        self.tenants.admit(sorted(cache.retained_per_tenant))
        by_label: dict[str, int] = {}
        for tenant, pages_retained in cache.retained_per_tenant.items():
            label = self.tenants.label(tenant)
            by_label[label] = by_label.get(label, 0) + pages_retained
        return self._labelled(
            GaugeMetricFamily, "tenant_kv_pages_retained",
            "KV pages under retention per tenant (what its retention budget pays for).",
            "tenant", by_label)


# The engine snapshot's unlabelled metrics, in exposition order: (kind, name, help, value).
_SnapshotMetric = tuple[str, str, str, Callable[[CacheStats, EngineStats], float]]
_SNAPSHOT_METRICS: tuple[_SnapshotMetric, ...] = (
    ("counter", "prefix_cache_queries", "Prefix cache queries, in prompt tokens.",
     lambda c, e: c.total.query_tokens),
    ("counter", "prefix_cache_hits", "Prefix cache hits, in prompt tokens.",
     lambda c, e: c.total.hit_tokens),
    ("counter", "prefix_cache_retention_hits",
     "Prefix cache hits on pages kept by retention (free and retained when hit), in "
     "prompt tokens.", lambda c, e: c.total.retention_hit_tokens),
    ("gauge", "kv_cache_usage_perc", "Fraction of KV pages referenced (1 = full).",
     lambda c, e: c.usage),
    ("gauge", "num_requests_running", "Requests in the running batch.",
     lambda c, e: e.num_running),
    ("gauge", "num_requests_waiting", "Requests waiting to be scheduled.",
     lambda c, e: e.num_waiting),
    ("gauge", "num_requests_waiting_max", "Waiting-queue bound (then HTTP 429).",
     lambda c, e: e.max_waiting),
    # the kv_pages family (by state) goes here
    ("gauge", "kv_pages_total", "KV pages in the pool.", lambda c, e: c.num_pages),
    ("gauge", "kv_pages_pinned", "KV pages pinned (never evicted).", lambda c, e: c.pages_pinned),
    ("gauge", "kv_pages_retained",
     "KV pages under retention (kept ahead of LRU eviction until a deadline).",
     lambda c, e: c.pages_retained),
    ("counter", "kv_retained_evicted",
     "Retained pages reused before their deadline (memory pressure).",
     lambda c, e: c.retained_evicted),
    ("counter", "kv_retention_expiries", "Retentions that ran out (pages back to the LRU).",
     lambda c, e: c.retention_expiries),
    ("counter", "kv_retention_reclaimed",
     "Retentions ended early: a tenant below its share took budget back.",
     lambda c, e: c.retention_reclaimed),
    ("gauge", "kv_fragmentation", "Allocated but unused slots / allocated slots.",
     lambda c, e: c.fragmentation),
    ("counter", "kv_evictions", "Cached pages whose hash was dropped to reuse the page.",
     lambda c, e: c.evictions),
    ("counter", "kv_cow_copies", "Copy-on-write page copies.", lambda c, e: c.cow_copies),
    ("counter", "num_preemptions", "Sequences preempted to free pages.",
     lambda c, e: e.num_preemptions),
    ("counter", "prefill_tokens_computed",
     "Prompt tokens that went through the model (not cached).",
     lambda c, e: e.prefill_tokens_computed),
    ("counter", "constrained_tokens",
     "Tokens sampled under a grammar (tool calls, structured outputs).",
     lambda c, e: e.constrained_tokens),
    ("counter", "grammar_compiles", "Distinct grammars compiled (cache misses).",
     lambda c, e: e.grammar_compiles),
    ("counter", "grammar_cache_hits", "Grammar requests served by the compile cache.",
     lambda c, e: e.grammar_cache_hits),
    ("counter", "grammar_compile_seconds", "Time spent compiling grammars.",
     lambda c, e: e.grammar_compile_seconds),
    ("counter", "grammar_limit_failures",
     "Grammar compiles refused for their time or memory limit (--grammar-compile-*).",
     lambda c, e: e.grammar_limit_failures),
    ("gauge", "grammar_cache_bytes", "Bytes of compiled grammars the cache holds.",
     lambda c, e: e.grammar_cache_bytes),
    ("counter", "spec_draft_tokens", "Speculative draft tokens proposed.",
     lambda c, e: e.spec_draft_tokens),
    ("counter", "spec_accepted_tokens",
     "Speculative draft tokens the model agreed with (emitted without a step).",
     lambda c, e: e.spec_accepted_tokens),
)
_PAGES_AT = 7  # where the kv_pages family sits in the exposition order


class GatewayMetrics:
    """The server's registry: gateway-observed request metrics + the engine collector."""

    def __init__(self, engine: EngineLike, model_name: str, max_agent_labels: int):
        self.model_name = model_name
        self.registry = CollectorRegistry(auto_describe=False)
        labels = ["model_name"]
        self.ttft = Histogram(
            PREFIX + "time_to_first_token_seconds",
            "Time from request arrival to the first token.",
            labels,
            buckets=_TTFT_BUCKETS,
            registry=self.registry,
        ).labels(model_name)
        self.itl = Histogram(
            PREFIX + "inter_token_latency_seconds",
            "Time between successive output deltas of a choice.",
            labels,
            buckets=_ITL_BUCKETS,
            registry=self.registry,
        ).labels(model_name)
        self.e2e = Histogram(
            PREFIX + "e2e_request_latency_seconds",
            "Time from request arrival to its last token.",
            labels,
            buckets=_E2E_BUCKETS,
            registry=self.registry,
        ).labels(model_name)
        self.prompt_tokens = Counter(
            PREFIX + "prompt_tokens",
            "Prompt tokens of finished requests.",
            labels,
            registry=self.registry,
        ).labels(model_name)
        self.cached_prompt_tokens = Counter(
            PREFIX + "prompt_tokens_cached",
            "Prompt tokens of finished requests served from cache.",
            labels,
            registry=self.registry,
        ).labels(model_name)
        self.generation_tokens = Counter(
            PREFIX + "generation_tokens",
            "Generated tokens of finished requests.",
            labels,
            registry=self.registry,
        ).labels(model_name)
        self.request_success = Counter(
            PREFIX + "request_success",
            "Finished requests by finish reason.",
            [*labels, "finished_reason"],
            registry=self.registry,
        )
        self.request_aborted = Counter(
            PREFIX + "request_aborted",
            "Requests aborted because the client went away.",
            labels,
            registry=self.registry,
        ).labels(model_name)
        self.registry.register(EngineCollector(engine, model_name, max_agent_labels))
        # what a recomputed prompt token costs a returning agent, from the TTFTs seen here:
        # the learned retention TTL's cap (cache/ttl_policy.py)
        self.recompute_cost = RecomputeCost()

    def timer(self, arrival: float | None = None) -> RequestTimer:
        return RequestTimer(self, time.perf_counter() if arrival is None else arrival)

    def render(self) -> bytes:
        return generate_latest(self.registry)


class RequestTimer:
    """Observes one request's deltas: TTFT once, inter-token gaps per choice, totals at the end."""

    __slots__ = ("metrics", "arrival", "first_token_at", "last_at", "done")

    def __init__(self, metrics: GatewayMetrics, arrival: float):
        self.metrics = metrics
        self.arrival = arrival
        self.first_token_at: float | None = None
        self.last_at: dict[int, float] = {}
        self.done = False

    def on_delta(self, delta: Delta, index: int | None = None) -> None:
        if not delta.token_ids:
            return
        now = time.perf_counter()
        key = delta.index if index is None else index
        if self.first_token_at is None:
            self.first_token_at = now
            self.metrics.ttft.observe(now - self.arrival)
        previous = self.last_at.get(key)
        if previous is not None:
            self.metrics.itl.observe(now - previous)
        self.last_at[key] = now

    def on_finish(self, usage: Usage, finish_reasons: Iterable[str | None]) -> None:
        if self.done:
            return
        self.done = True
        self.metrics.e2e.observe(time.perf_counter() - self.arrival)
        if self.first_token_at is not None:
            self.metrics.recompute_cost.observe(self.first_token_at - self.arrival,
                                                usage.prompt_tokens - usage.cached_tokens)
        self.metrics.prompt_tokens.inc(usage.prompt_tokens)
        self.metrics.cached_prompt_tokens.inc(usage.cached_tokens)
        self.metrics.generation_tokens.inc(usage.completion_tokens)
        for reason in finish_reasons:
            self.metrics.request_success.labels(self.metrics.model_name, reason or "unknown").inc()

    def on_abort(self) -> None:
        if not self.done:
            self.done = True
            self.metrics.request_aborted.inc()


# the second KV tier: (metric, key in EngineStats.tier, help); counters unless named a gauge
_TIER_METRICS = (
    ("kv_tier_pages_spilled", "pages_spilled", "Evicted cached pages written to the second tier."),
    ("kv_tier_bytes_spilled", "bytes_spilled", "Bytes written to the second tier."),
    ("kv_tier_spills_dropped", "spills_dropped", "Evicted pages the tier could not take."),
    ("kv_tier_probes", "probes", "Loads asked of the second tier."),
    ("kv_tier_hits", "hits", "Loads that brought at least one page back."),
    ("kv_tier_pages_loaded", "pages_loaded", "Pages loaded from the second tier."),
    ("kv_tier_bytes_loaded", "bytes_loaded", "Bytes loaded from the second tier."),
    ("kv_tier_load_seconds", "load_seconds", "Time the tier worker spent fetching and verifying."),
    ("kv_tier_corrupt", "corrupt", "Tier entries that failed their checksum (recomputed)."),
    ("kv_tier_rejected", "rejected", "Intact tier entries for another key or layout (recomputed)."),
    ("kv_tier_late", "late", "Tier loads past their deadline (recomputed)."),
    ("kv_tier_errors", "errors", "Tier store failures, e.g. Redis down (recomputed)."),
    ("kv_tier_recompute_seconds_saved", "recompute_seconds_saved",
     "Estimated prefill time the tier's loads saved."),
)


def tier_metrics(tier: Mapping[str, float], counter: Callable[[str, str, float], Metric],
                 gauge: Callable[[str, str, float], Metric]) -> Iterator[Metric]:
    """The second tier's counters and its size (see engine/kv_tier.py), built with the
    collector's ``counter`` / ``gauge`` (its prefix and labels)."""
    for name, key, text in _TIER_METRICS:
        yield counter(name, text, tier[key])
    yield gauge("kv_tier_entries", "Entries in the second tier.", tier["entries"])
    yield gauge("kv_tier_bytes_used", "Bytes held by the second tier.", tier["bytes_used"])
