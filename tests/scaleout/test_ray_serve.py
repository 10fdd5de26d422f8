"""prefixgate on Ray Serve (#40.2): a two-node Ray cluster on loopback
(``ray.cluster_utils.Cluster``: a head and a worker, each offering one ``prefixgate`` resource,
so each of the two replicas lands on its own node), the real default model in each replica
with a small KV pool, our prefix-aware request router, Ray's HTTP proxy in front.

The cluster runs in a pytest process of its own (``test_ray_serve_in_its_own_process`` starts
this module again with ``PREFIXGATE_RAY_CHILD=1``): once in a clean-clone run, the Ray driver's
process died under a pytest-xdist worker, which took the worker down and left xdist waiting.

Checked: a repeated prefix goes back to the replica that holds it (the router follows both
replicas' KV events) and hits its cache; a stream passes through as SSE; the OpenAI chat,
Responses and Anthropic Messages surfaces all answer through the ingress."""

from __future__ import annotations

import concurrent.futures
import os
import re
import subprocess
import sys
import warnings
from pathlib import Path

import httpx
import pytest

from tests.scaleout.conftest import free_port, wait_for

pytestmark = pytest.mark.slow

try:
    import ray
    from ray import serve
    from ray.cluster_utils import Cluster
except ImportError as exc:  # `make test` installs ray[serve] (the dev extras)
    ray = None
    RAY_MISSING = f"SKIPPED LOUDLY: ray[serve] cannot be imported ({exc}); `make setup`"

PAGE_SIZE = 16
CHILD = os.environ.get("PREFIXGATE_RAY_CHILD") == "1"
TESTS = ("test_repeat_prefix_goes_to_the_replica_holding_it", "test_stream_and_three_surfaces")
in_child = pytest.mark.skipif(not CHILD, reason="runs in test_ray_serve_in_its_own_process")


@pytest.mark.skipif(CHILD, reason="this is the child")
def test_ray_serve_in_its_own_process():
    if ray is None:
        pytest.skip(RAY_MISSING)
    env = {k: v for k, v in os.environ.items() if not k.startswith("PYTEST_XDIST")}
    env["PREFIXGATE_RAY_CHILD"] = "1"
    run = subprocess.run(
        [sys.executable, "-m", "pytest", "-p", "no:xdist", "-p", "no:cacheprovider", "-v",
         "--timeout", "500", __file__],
        cwd=Path(__file__).resolve().parents[2], env=env, capture_output=True, text=True,
        timeout=540)
    out = run.stdout + run.stderr
    for name in TESTS:  # each test's own verdict, printed before the cluster's teardown
        assert re.search(rf"::{name} PASSED", out), out[-4000:]
    if run.returncode != 0:
        # both passed: an error in the teardown still fails; a child killed after its verdicts
        # (Ray's shutdown) is said loudly
        assert " ERROR" not in out and " FAILED" not in out, out[-4000:]
        warnings.warn(f"Ray's teardown ended the child with {run.returncode}: {out[-1500:]}",
                      stacklevel=1)
FOLLOWED = "the router follows both replicas' KV events"


@pytest.fixture(scope="module")
def ray_app():
    if ray is None:
        pytest.skip(RAY_MISSING)
    from prefixgate.gateway.scaleout.ray_serve.application import (
        RayServeOptions,
        build_application,
    )
    from prefixgate.gateway.scaleout.ray_serve.replica import ReplicaOptions

    cluster = Cluster(initialize_head=True, head_node_args={
        "num_cpus": 1, "resources": {"prefixgate": 1}, "include_dashboard": False})
    cluster.add_node(num_cpus=1, resources={"prefixgate": 1})
    port = free_port()
    try:
        ray.init(address=cluster.address, include_dashboard=False, log_to_driver=False)
        serve.start(http_options={"host": "127.0.0.1", "port": port}, proxy_location="HeadOnly")
        options = RayServeOptions(
            num_replicas=2, replica_num_cpus=0.25, replica_resources={"prefixgate": 1},
            ingress_num_cpus=0.1, routing_stats_period_s=0.5,
            replica=ReplicaOptions(engine={"num_pages": 96, "page_size": PAGE_SIZE,
                                           "max_waiting": 64}))
        serve.run(build_application(options), name="prefixgate", route_prefix="/")
        yield f"http://127.0.0.1:{port}"
    finally:
        serve.shutdown()
        ray.shutdown()
        cluster.shutdown()


def _router(url: str) -> dict:
    routers = httpx.get(url + "/ray/router", timeout=30).json()["routers"]
    return routers[0] if routers else {}


def _chat(url: str, messages: list[dict], **extra) -> httpx.Response:
    reply = httpx.post(url + "/v1/chat/completions", timeout=300, json={
        "messages": messages, "max_tokens": 4, "temperature": 0, **extra})
    assert reply.status_code == 200, reply.text
    return reply


def _system(topic: str) -> str:
    return f"You are the {topic} agent. Rules: " + " ".join(f"{topic}-rule-{j}" for j in range(60))


@in_child
def test_repeat_prefix_goes_to_the_replica_holding_it(ray_app):
    url = ray_app
    assert httpx.get(url + "/v1/models", timeout=60).status_code == 200  # builds the router
    wait_for(lambda: len(_router(url).get("replicas", {})) == 2, 120, FOLLOWED,
             interval_s=0.2, explain=lambda: str(_router(url)))
    topics = ["billing", "search", "triage", "review"]
    firsts = {}
    with concurrent.futures.ThreadPoolExecutor(len(topics)) as pool:  # spread by load
        replies = pool.map(lambda t: _chat(url, [{"role": "system", "content": _system(t)},
                                                 {"role": "user", "content": "start"}]), topics)
        for topic, reply in zip(topics, replies, strict=True):
            firsts[topic] = reply.headers["x-prefixgate-replica"]
    wait_for(lambda: sum(r["blocks"] for r in _router(url)["replicas"].values())
             >= 4 * (len(_system("x").split()) // 2 // PAGE_SIZE), 60,
             "the first requests' blocks in the router's index", interval_s=0.1,
             explain=lambda: str(_router(url)))
    for topic in topics:
        reply = _chat(url, [{"role": "system", "content": _system(topic)},
                            {"role": "user", "content": "start"},
                            {"role": "assistant", "content": "ok"},
                            {"role": "user", "content": f"continue with {topic}"}])
        usage = reply.json()["usage"]
        assert reply.headers["x-prefixgate-replica"] == firsts[topic], (topic, _router(url))
        assert usage["prompt_tokens_details"]["cached_tokens"] >= 4 * PAGE_SIZE, usage
    reasons = _router(url)["reasons"]
    assert reasons.get("prefix", 0) + reasons.get("load", 0) + reasons.get("session", 0) \
        + reasons.get("hash", 0) >= len(topics), reasons


@in_child
def test_stream_and_three_surfaces(ray_app):
    """The official SDKs through Ray's proxy: a streamed chat, Responses, Anthropic Messages."""
    import anthropic
    import openai

    url = ray_app
    model = httpx.get(url + "/v1/models", timeout=60).json()["data"][0]["id"]
    system = _system("stream")
    client = openai.OpenAI(base_url=url + "/v1", api_key="unused", timeout=300)
    chunks = list(client.chat.completions.create(
        model=model, max_tokens=6, temperature=0, stream=True,
        stream_options={"include_usage": True},
        messages=[{"role": "system", "content": system}, {"role": "user", "content": "hi"}]))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert len(chunks) >= 3 and text, chunks
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens > 0

    response = client.responses.create(model=model, instructions=system, input="hi",
                                       max_output_tokens=4, temperature=0)
    assert response.status in ("completed", "incomplete")  # incomplete: max_output_tokens
    assert response.output_text and response.usage.output_tokens > 0
    message = anthropic.Anthropic(base_url=url, api_key="unused", timeout=300).messages.create(
        model=model, system=system, max_tokens=4, messages=[{"role": "user", "content": "hi"}])
    assert message.type == "message" and message.usage.output_tokens > 0
    bad = httpx.post(url + "/v1/messages", timeout=60, content=b"{not json",
                     headers={"content-type": "application/json"})
    assert bad.status_code == 400 and bad.json()["type"] == "error", bad.text
