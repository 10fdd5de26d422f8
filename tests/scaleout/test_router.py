"""The router as a pass-through: bytes, errors, disconnects, retries, fleet endpoints."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys

import httpx
import pytest

from tests.scaleout.conftest import (
    REPO,
    free_port,
    kill_process,
    router_settings,
    running_router,
    wait_for,
)

pytestmark = pytest.mark.slow
CREATED = re.compile(rb'"created":\d+')


def chat_body(system: str, **extra) -> dict:
    return {"messages": [{"role": "system", "content": system},
                         {"role": "user", "content": "Name a colour."}],
            "max_tokens": 4, "temperature": 0, **extra}


def replica_url(fleet, response: httpx.Response) -> str:
    name = response.headers["x-prefixgate-replica"]
    return next(r.url for r in fleet.replicas if r.replica_id == name)


@pytest.mark.parametrize("stream", [True, False])
def test_responses_pass_through_byte_for_byte(fleet, stream):
    body = chat_body(f"Byte-for-byte check, stream={stream}. " * 8, stream=stream,
                     **({"stream_options": {"include_usage": True}} if stream else {}))
    with httpx.Client(timeout=120) as client:
        first = client.post(fleet.router_url + "/v1/chat/completions", json=body)
        assert first.status_code == 200
        target = replica_url(fleet, first)
        # Same request id and same warm cache on both paths: only `created` may differ.
        headers = {"X-Request-Id": f"same-id-{stream}"}
        direct = client.post(target + "/v1/chat/completions", json=body, headers=headers)
        routed = client.post(fleet.router_url + "/v1/chat/completions", json=body,
                             headers=headers)
    assert replica_url(fleet, routed) == target
    assert routed.headers["x-prefixgate-route"] == "prefix"
    assert routed.headers["x-request-id"] == "same-id-" + str(stream)
    assert routed.headers["content-type"] == direct.headers["content-type"]
    assert CREATED.sub(b"", routed.content) == CREATED.sub(b"", direct.content)
    if stream:
        assert routed.content.endswith(b"data: [DONE]\n\n")
        assert b'"cached_tokens":' in routed.content


def test_errors_are_passed_on(fleet):
    target = fleet.replicas[0].url
    with httpx.Client(timeout=60) as client:
        for body in ({"messages": []}, {"messages": [{"role": "user", "content": "x"}],
                                        "model": "no-such-model"}):
            direct = client.post(target + "/v1/chat/completions", json=body)
            routed = client.post(fleet.router_url + "/v1/chat/completions", json=body)
            assert routed.status_code == direct.status_code >= 400
            assert routed.json() == direct.json()
        routed = client.post(fleet.router_url + "/v1/completions", content=b"{not json",
                             headers={"Content-Type": "application/json"})
        assert routed.status_code == 400
        assert routed.json()["error"]["code"] == "invalid_json"


def test_a_client_disconnect_aborts_the_request_on_the_replica(fleet):
    def aborted(url: str) -> float:
        text = httpx.get(url + "/metrics", timeout=30).text
        match = re.search(r"^prefixgate:request_aborted_total\{[^}]*\} (\S+)$", text, re.M)
        return float(match.group(1)) if match else 0.0

    before = {r.url: aborted(r.url) for r in fleet.replicas}
    body = chat_body("Talk for a long time. " * 4, max_tokens=400, stream=True, ignore_eos=True)
    with httpx.Client(timeout=120) as client, client.stream(
            "POST", fleet.router_url + "/v1/chat/completions", json=body) as response:
        assert response.status_code == 200
        target = replica_url(fleet, response)
        for chunk in response.iter_raw():
            if b"content" in chunk:
                break  # one token arrived: hang up
    wait_for(lambda: aborted(target) > before[target], 60, "the replica to abort the request")
    replica = next(r for r in fleet.replicas if r.url == target)
    # Its pages come back (nothing stays referenced) once the abort is processed.
    wait_for(lambda: replica.engine.cache_stats().pages_used == 0, 60, "pages to be released")


def test_a_refused_connection_is_retried_on_another_replica(fleet):
    dead = f"http://127.0.0.1:{free_port()}"  # nothing listens there
    live = fleet.replicas[0].url
    settings = router_settings([dead, live], fleet.redis.url, policy="round_robin",
                               health_interval_s=60)
    with running_router(settings, fleet.tokenizer, fleet.model_id) as (url, app):
        router = app.state.router
        victim = router.fleet.get(dead)
        wait_for(lambda: not victim.reachable, 30, "the first probe to find it down")
        victim.reachable = True  # as if it died after the probe
        # Round robin walks the URLs in sorted order: make the dead one its next pick.
        router.policy._next = sorted([dead, live]).index(dead)
        response = httpx.post(url + "/v1/chat/completions", timeout=120,
                              json=chat_body("Retry me. " * 5))
        assert response.status_code == 200
        assert response.headers["x-prefixgate-route"] == "retry"
        assert replica_url(fleet, response) == live
        assert not victim.reachable  # marked down until a probe says otherwise
        reasons = [d.reason for d in router.decisions]
        assert reasons == ["round_robin", "retry"]
        metrics = httpx.get(url + "/metrics", timeout=30).text
        assert re.search(r'^prefixgate:router_retries_total\{replica="[^"]+"\} 1\.0$', metrics,
                         re.M)


def test_fleet_endpoints(fleet):
    with httpx.Client(base_url=fleet.router_url, timeout=60) as client:
        models = client.get("/v1/models").json()
        assert [m["id"] for m in models["data"]] == [
            fleet.replicas[0].app.state.server.model_name]
        health = client.get("/health").json()
        assert health["status"] == "ok" and health["redis"] == "up"
        assert {r["name"] for r in health["replicas"]} == {r.replica_id for r in fleet.replicas}
        assert all(r["routable"] and r["heartbeat"] == "fresh" for r in health["replicas"])
        reset = client.post("/v1/cache/reset").json()
        assert set(reset["replicas"]) == {r.replica_id for r in fleet.replicas}
        tokens = client.post("/tokenize", json={"prompt": "hello"}).json()
        assert tokens["count"] >= 1
        client.post("/v1/chat/completions", json=chat_body("Metrics please. " * 3))
        metrics = client.get("/metrics").text
        for family in ("prefixgate:router_decisions_total", "prefixgate:router_redis_up 1.0",
                       "prefixgate:router_replica_routable", "prefixgate:fleet_kv_pages_total",
                       "prefixgate:fleet_prefix_cache_queries_total"):
            assert family in metrics, family
        # replicas publish their counters to Redis in the background: wait for this request's
        stats = wait_for(lambda: (lambda s: s if s["global"]["query_tokens"] > 0 else None)(
            client.get("/v1/cache/stats").json()), 30, "fleet counters in Redis")
        assert stats["object"] == "fleet.cache.stats" and stats["source"] == "redis"
        beats = [client.get(f"{r.url}/v1/cache/stats").json() for r in fleet.replicas]
        assert stats["num_pages"] == sum(b["num_pages"] for b in beats)
        assert 0 <= stats["pages_used"] <= stats["num_pages"] and stats["page_size"] == 16
        page = client.get("/dashboard")  # the replicas' dashboard, over the fleet's stats
        assert page.status_code == 200 and "v1/cache/stats" in page.text


def test_without_redis_the_router_balances_from_its_own_view(fleet):
    urls = [r.url for r in fleet.replicas]
    settings = router_settings(urls, None)
    with running_router(settings, fleet.tokenizer, fleet.model_id) as (url, app):
        router = app.state.router
        wait_for(lambda: all(r.reachable for r in router.fleet), 10, "probes")
        with httpx.Client(timeout=120) as client:
            body = chat_body("No Redis here. " * 10, user="agent-7")
            client.post(url + "/v1/chat/completions", json=body).raise_for_status()
            again = client.post(url + "/v1/chat/completions", json=body)
            stats = client.get(url + "/v1/cache/stats").json()
        # Our own recent routes give affinity without the shared index.
        assert again.headers["x-prefixgate-route"] == "prefix"
        assert router.decisions[-1].url == router.decisions[-2].url
        assert stats["source"] == "replicas" and stats["router"]["redis"] == "off"


def test_prefixgate_route_command_serves_the_fleet(fleet):
    """The production path: `prefixgate route` as a process (tokenizer-only load, env config)."""
    port = free_port()
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1",
           "PREFIXGATE_REPLICA": ",".join(r.url for r in fleet.replicas),
           "PREFIXGATE_REDIS_URL": fleet.redis.url, "PREFIXGATE_HEARTBEAT_TTL": "1"}
    process = subprocess.Popen(
        [sys.executable, "-m", "prefixgate.gateway.cli", "route", "--port", str(port)], env=env,
        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    try:
        def ready() -> bool:
            if process.poll() is not None:
                raise AssertionError(f"prefixgate route exited: {process.stderr.read()[-2000:]}")
            try:
                return httpx.get(url + "/health", timeout=2).json()["redis"] == "up"
            except (httpx.HTTPError, ValueError, KeyError):
                return False

        wait_for(ready, 120, "prefixgate route to serve", interval_s=0.2)
        body = chat_body("Through the router process. " * 6, user="cli-agent")
        first = httpx.post(url + "/v1/chat/completions", json=body, timeout=120)
        again = httpx.post(url + "/v1/chat/completions", json=body, timeout=120)
        assert first.status_code == again.status_code == 200
        assert again.headers["x-prefixgate-route"] == "prefix"
        assert again.json()["usage"]["prompt_tokens_details"]["cached_tokens"] > 0
    finally:
        process.send_signal(signal.SIGINT)
        try:
            code = process.wait(30)
        finally:
            kill_process(process)
    log = process.stderr.read()
    assert code == 0, log[-2000:]
    assert "prefixgate router ready at" in log and "route req-" in log  # one line per placement
