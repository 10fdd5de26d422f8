"""Clients that vanish mid-stream abort their requests: no page leaks."""

from __future__ import annotations

import asyncio
import contextlib
import json
import uuid

import httpx
import pytest

from tests.gateway.conftest import wait_idle

pytestmark = pytest.mark.slow

NUM_STREAMS = 50
# Cut streams ask for far more tokens than they read: only an abort frees them early.
CUT_MAX_TOKENS = 1000
FULL_MAX_TOKENS = 6


async def one_stream(client: httpx.AsyncClient, model: str, system: str, i: int, cut: bool) -> dict:
    body = {
        "model": model,
        "messages": [
            {"role": "system", "content": system},
            {"role": "user", "content": f"Task {i}"},
        ],
        "max_tokens": CUT_MAX_TOKENS if cut else FULL_MAX_TOKENS,
        "ignore_eos": cut,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    events = []
    async with client.stream("POST", "/v1/chat/completions", json=body) as response:
        assert response.status_code == 200, await response.aread()
        async for line in response.aiter_lines():
            if not line:
                continue
            events.append(line)
            if cut and len(events) >= 3:  # role chunk + some content: mid-stream
                break  # leaving the block closes the connection
    return {"cut": cut, "events": events}


async def run_streams(base_url: str, model: str) -> list[dict]:
    system = f"[{uuid.uuid4().hex[:12]}] You are one of fifty parallel workers. " * 4
    limits = httpx.Limits(max_connections=NUM_STREAMS)
    async with httpx.AsyncClient(base_url=base_url, timeout=300, limits=limits) as client:
        return await asyncio.gather(
            *(one_stream(client, model, system, i, cut=i % 2 == 0) for i in range(NUM_STREAMS))
        )


def aborted_total(client: httpx.Client) -> float:
    for line in client.get("/metrics").text.splitlines():
        if line.startswith("prefixgate:request_aborted_total"):
            return float(line.rsplit(" ", 1)[1])
    raise AssertionError("prefixgate:request_aborted_total missing from /metrics")


def test_fifty_streams_half_cut_leak_no_pages(client, gateway):
    aborted_before = aborted_total(client)
    results = asyncio.run(run_streams(gateway.open_url, gateway.model))

    finished = [r for r in results if not r["cut"]]
    assert len(finished) == NUM_STREAMS // 2
    for r in finished:
        assert r["events"][-1] == "data: [DONE]"
        usage = json.loads(r["events"][-2][len("data: ") :])["usage"]
        assert usage["completion_tokens"] <= FULL_MAX_TOKENS

    stats = wait_idle(client)
    assert stats["engine"]["num_running"] == 0
    assert stats["engine"]["num_waiting"] == 0
    assert stats["num_sequences"] == 0
    assert stats["pages_used"] == 0
    assert (
        stats["pages_used"] + stats["pages_cached_free"] + stats["pages_free"] == stats["num_pages"]
    )
    assert aborted_total(client) - aborted_before == NUM_STREAMS // 2


async def cancel_once_running(base_url: str, model: str) -> None:
    """Start a long non-streaming request, wait until the engine runs it, then hang up."""
    body = {
        "model": model,
        "messages": [{"role": "user", "content": "Write a very long story."}],
        "max_tokens": CUT_MAX_TOKENS,
        "ignore_eos": True,
    }
    async with (
        httpx.AsyncClient(base_url=base_url, timeout=300) as caller,
        httpx.AsyncClient(base_url=base_url, timeout=60) as observer,
    ):
        task = asyncio.create_task(caller.post("/v1/chat/completions", json=body))
        for _ in range(6000):
            stats = (await observer.get("/v1/cache/stats")).json()
            if stats["engine"]["num_running"] >= 1 and stats["pages_used"] >= 1:
                break
            await asyncio.sleep(0.01)
        else:
            raise AssertionError("the request never started running")
        assert not task.done()
        task.cancel()  # closes the connection mid-request
        with contextlib.suppress(asyncio.CancelledError):
            await task


def test_non_streaming_client_gone_is_aborted(client, gateway):
    aborted_before = aborted_total(client)
    asyncio.run(cancel_once_running(gateway.open_url, gateway.model))
    stats = wait_idle(client)
    assert stats["pages_used"] == 0 and stats["num_sequences"] == 0
    assert aborted_total(client) - aborted_before == 1
