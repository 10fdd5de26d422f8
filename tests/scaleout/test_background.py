"""Background loops stop even when their cancellation is swallowed (gateway/scaleout/background.py).

The failure this guards against hung a CI run for 600 s: a publisher's loop caught, as a Redis
timeout, what was really its own cancellation, went on looping, and ``stop()`` awaited it for
ever."""

from __future__ import annotations

import asyncio
import logging
from types import SimpleNamespace

import pytest

from prefixgate.gateway.scaleout import publisher as publisher_module
from prefixgate.gateway.scaleout.background import cancel_and_wait, cancel_requested
from prefixgate.gateway.scaleout.publisher import PublisherConfig, ReplicaPublisher

# A hang detector only: each stop below takes milliseconds; the old code never returned.
HANG_S = 30.0


async def _swallow_once(ended: list[str]) -> None:
    """A loop that takes its first cancellation for a timeout and goes on (the bug's shape)."""
    swallowed = False
    while True:
        try:
            await asyncio.sleep(3600)
        except asyncio.CancelledError:
            if swallowed:
                ended.append("second cancel")
                raise
            swallowed = True
            asyncio.current_task().uncancel()  # what a library's timeout does with it


def test_a_swallowed_cancellation_is_sent_again():
    async def main() -> list[str]:
        ended: list[str] = []
        task = asyncio.create_task(_swallow_once(ended))
        await asyncio.sleep(0)
        await asyncio.wait_for(cancel_and_wait([task, None], grace_s=HANG_S), HANG_S)
        assert task.done() and task.cancelled()
        return ended

    assert asyncio.run(main()) == ["second cancel"]


def test_a_task_that_never_ends_is_left_behind_loudly(caplog):
    async def main() -> None:
        release = asyncio.Event()

        async def stubborn() -> None:
            while not release.is_set():
                try:
                    await asyncio.sleep(3600)
                except asyncio.CancelledError:
                    asyncio.current_task().uncancel()
        task = asyncio.create_task(stubborn(), name="stubborn")
        await asyncio.sleep(0)
        with caplog.at_level(logging.ERROR):
            await asyncio.wait_for(cancel_and_wait([task], grace_s=0.3), HANG_S)
        assert not task.done()
        assert "stubborn" in caplog.text and "left behind" in caplog.text
        release.set()
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)

    asyncio.run(main())


def test_cancel_requested_tells_a_disguised_cancellation():
    async def main() -> str:
        async def loop() -> str:
            while True:
                try:
                    try:
                        await asyncio.sleep(3600)
                    except asyncio.CancelledError:
                        raise TimeoutError("a library's timeout") from None
                except TimeoutError:
                    if cancel_requested():
                        raise
                    return "not cancelled"
        task = asyncio.create_task(loop())
        await asyncio.sleep(0)
        assert not cancel_requested()
        task.cancel()
        with pytest.raises(TimeoutError):
            await task
        return "re-raised"

    assert asyncio.run(main()) == "re-raised"


class _Engine(SimpleNamespace):
    """What the publisher reads of an engine, nothing more."""

    def __init__(self) -> None:
        super().__init__(model_id="m", page_size=16, hash_seed=0)

    def add_event_sink(self, sink) -> None: ...

    def cached_block_hashes(self) -> list[bytes]:
        return [bytes([i]) * 16 for i in range(4)]

    def load_estimate(self) -> tuple[int, int, int, int]:
        return 0, 0, 64, 1

    def cache_stats(self) -> SimpleNamespace:
        return SimpleNamespace(num_pages=64)

    def engine_stats(self) -> SimpleNamespace:
        return SimpleNamespace(max_waiting=8)


@pytest.mark.slow
def test_the_publisher_stops_when_redis_turns_its_cancel_into_a_timeout(redis_server,
                                                                        monkeypatch):
    """The resync is cancelled mid-call and the Redis layer raises a TimeoutError instead:
    ``stop()`` still returns, and the loop ended on that first cancellation."""
    calls: list[str] = []

    async def resync_that_hides_cancels(self, held):
        calls.append("resync")
        try:
            await asyncio.sleep(3600)
        except asyncio.CancelledError:
            raise TimeoutError("Timeout reading from redis") from None

    monkeypatch.setattr(publisher_module.IndexWriter, "resync", resync_that_hides_cancels)

    async def main() -> None:
        config = PublisherConfig(redis_server.url, "cancel-check", "http://127.0.0.1:1",
                                 heartbeat_ttl_s=0.3)
        publisher = ReplicaPublisher(_Engine(), config, served_model="m")
        await publisher.start()
        task = publisher._task
        while not calls:
            await asyncio.sleep(0.01)
        await asyncio.wait_for(publisher.stop(), HANG_S)
        assert task is not None and task.done()
        assert calls == ["resync"]  # not retried after its cancellation

    asyncio.run(main())
