"""/metrics is valid Prometheus text with the vLLM-style names, and the counters move."""

from __future__ import annotations

import uuid

import pytest
from prometheus_client.parser import text_string_to_metric_families

pytestmark = pytest.mark.slow


def scrape(client) -> dict[str, list]:
    response = client.get("/metrics")
    assert response.status_code == 200
    assert response.headers["content-type"].startswith("text/plain")
    return {f.name: f.samples for f in text_string_to_metric_families(response.text)}


def value(families, family: str, sample: str, **labels) -> float:
    matches = [
        s.value
        for s in families[family]
        if s.name == sample and all(s.labels.get(k) == v for k, v in labels.items())
    ]
    assert len(matches) == 1, (family, sample, labels, families.get(family))
    return matches[0]


def test_metrics_parse_and_count(client, gateway):
    before = scrape(client)
    for name in (
        "prefixgate:prefix_cache_queries",
        "prefixgate:prefix_cache_hits",
        "prefixgate:kv_cache_usage_perc",
        "prefixgate:num_requests_running",
        "prefixgate:num_requests_waiting",
        "prefixgate:time_to_first_token_seconds",
        "prefixgate:inter_token_latency_seconds",
        "prefixgate:e2e_request_latency_seconds",
        "prefixgate:prompt_tokens",
        "prefixgate:generation_tokens",
        "prefixgate:kv_pages",
        "prefixgate:agent_prefix_cache_hits",
        "prefixgate:tenant_prefix_cache_hits",
    ):
        assert name in before, name

    agent = f"metrics-{uuid.uuid4().hex[:6]}"
    system = f"[{uuid.uuid4().hex}] " + "Summarise logs for the on-call engineer. " * 10
    results = []
    for question in ("first", "second"):
        response = client.post(
            "/v1/chat/completions",
            headers={"X-Agent-Id": agent},
            json={
                "model": gateway.model,
                "max_tokens": 3,
                "stream": True,
                "stream_options": {"include_usage": True},
                "messages": [
                    {"role": "system", "content": system},
                    {"role": "user", "content": question},
                ],
            },
        )
        results.append(response)
    after = scrape(client)

    q = "prefixgate:prefix_cache_queries"
    assert value(after, q, q + "_total", model_name=gateway.model) > value(
        before, q, q + "_total", model_name=gateway.model
    )
    h = "prefixgate:prefix_cache_hits"
    assert value(after, h, h + "_total") > value(before, h, h + "_total")
    ttft = "prefixgate:time_to_first_token_seconds"
    assert value(after, ttft, ttft + "_count") >= value(before, ttft, ttft + "_count") + 2
    e2e = "prefixgate:e2e_request_latency_seconds"
    assert value(after, e2e, e2e + "_count") >= value(before, e2e, e2e + "_count") + 2
    gen = "prefixgate:generation_tokens"
    assert value(after, gen, gen + "_total") >= value(before, gen, gen + "_total") + 2
    ah = "prefixgate:agent_prefix_cache_hits"
    agent_labels = {s.labels["agent"] for s in after[ah]}
    # bounded: either the agent has its own series or it was folded into __other__
    label = agent if agent in agent_labels else "__other__"
    assert value(after, ah, ah + "_total", agent=label) > 0
    usage = value(after, "prefixgate:kv_cache_usage_perc", "prefixgate:kv_cache_usage_perc")
    assert 0.0 <= usage <= 1.0
    pages = {s.labels["state"]: s.value for s in after["prefixgate:kv_pages"]}
    assert sum(pages.values()) == value(
        after, "prefixgate:kv_pages_total", "prefixgate:kv_pages_total"
    )


def test_agent_labels_are_bounded_and_sticky():
    from prefixgate.cache.stats import HitStats
    from prefixgate.gateway.http.metric_labels import OTHER_LABEL, StickyLabeler

    labeler = StickyLabeler(max_labels=2)
    first = {"a": HitStats(1, 100, 10), "b": HitStats(1, 300, 30), "c": HitStats(1, 200, 20)}
    folded = labeler.fold(first)
    # the two busiest at first sight keep their own label; the rest share one
    assert folded == {"b": (300, 30), "c": (200, 20), OTHER_LABEL: (100, 10)}
    later = {**first, "a": HitStats(9, 9000, 900), "d": HitStats(1, 50, 5)}
    folded = labeler.fold(later)
    # "a" became the busiest but stays folded: series never move between labels (monotonic)
    assert folded == {"b": (300, 30), "c": (200, 20), OTHER_LABEL: (9050, 905)}
    assert len(folded) <= 3


def test_retention_series_per_tenant_and_agent_fold_like_the_hits():
    """Retention hits per tenant/agent carry the same (bounded) labels as the hit series; the
    pages each tenant retains are a gauge; the learned TTL's recompute cost comes from TTFTs."""
    from prometheus_client import CollectorRegistry, generate_latest

    from prefixgate.cache.stats import CacheStats, HitStats
    from prefixgate.engine.api import EngineStats, Usage
    from prefixgate.gateway.http.metric_labels import OTHER_LABEL
    from prefixgate.gateway.server.metrics import EngineCollector, GatewayMetrics

    hits = {"a": HitStats(2, 300, 200, 1, 64), "b": HitStats(1, 200, 0), "c": HitStats(1, 100, 50, 1, 32)}
    cache = CacheStats(
        num_pages=10, page_size=16, pages_used=0, pages_cached_free=4, pages_free=6,
        pages_pinned=0, fragmentation=0.0, evictions=0, cow_copies=0, num_sequences=0,
        total=HitStats(4, 600, 250, 2, 96), per_tenant={"alpha": HitStats(4, 600, 250, 2, 96)},
        per_agent=hits, pages_retained=3, retained_per_tenant={"alpha": 3},
    )

    class Engine:
        def cache_stats(self):
            return cache

        def engine_stats(self):
            return EngineStats(0, 0, 8, 0, 0, 0, "torch", "cpu")

    registry = CollectorRegistry(auto_describe=False)
    registry.register(EngineCollector(Engine(), "m", max_agent_labels=2))
    families = {f.name: f.samples for f in text_string_to_metric_families(generate_latest(registry).decode())}
    name = "prefixgate:prefix_cache_retention_hits"
    assert value(families, name, name + "_total") == 96
    agents = "prefixgate:agent_prefix_cache_retention_hits"
    assert value(families, agents, agents + "_total", agent="a") == 64
    assert value(families, agents, agents + "_total", agent="b") == 0
    assert value(families, agents, agents + "_total", agent=OTHER_LABEL) == 32  # c: the third
    tenants = "prefixgate:tenant_prefix_cache_retention_hits"
    assert value(families, tenants, tenants + "_total", tenant="alpha") == 96
    retained = "prefixgate:tenant_kv_pages_retained"
    assert value(families, retained, retained, tenant="alpha") == 3

    metrics = GatewayMetrics(Engine(), "m", 2)
    assert metrics.recompute_cost.num_samples == 0
    timer = metrics.timer(arrival=0.0)
    timer.first_token_at = 0.5
    timer.on_finish(Usage(prompt_tokens=600, completion_tokens=1, cached_tokens=100), ["stop"])
    assert metrics.recompute_cost.num_samples == 1  # 0.5 s for 500 computed tokens
