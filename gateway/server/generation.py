"""Engine requests as delta streams that always release their engine request.

A :class:`DeltaStream` pulls the engine's first delta before the HTTP response starts, so
validation, context-length and overload errors still get their proper status code even for
``stream=true``. Closing it early (client gone) closes the engine iterator and aborts the
request, which frees its pages.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Sequence

from prefixgate.engine.api import Delta, EngineLike, GenerationRequest, Usage


def sum_usage(usages: Sequence[Usage]) -> Usage:
    return Usage(
        prompt_tokens=sum(u.prompt_tokens for u in usages),
        completion_tokens=sum(u.completion_tokens for u in usages),
        cached_tokens=sum(u.cached_tokens for u in usages),
    )


class DeltaStream:
    """One engine request as an async iterator of deltas, primed with its first delta.

    Use ``await DeltaStream.open(engine, request)`` (raises the engine's request errors), iterate,
    and always ``await stream.aclose()`` (idempotent): unless the request finished, that aborts it.
    """

    def __init__(self, engine: EngineLike, request: GenerationRequest):
        self.engine = engine
        self.request = request
        self.usage: Usage | None = None  # set by the final delta
        self._iterator: AsyncIterator[Delta] | None = None
        self._first: Delta | None = None
        self._closed = False

    @classmethod
    async def open(cls, engine: EngineLike, request: GenerationRequest) -> DeltaStream:
        stream = cls(engine, request)
        try:
            stream._iterator = aiter(engine.generate(request))
            stream._first = await anext(stream._iterator)
        except StopAsyncIteration:
            await stream.aclose()
            raise RuntimeError(
                f"engine stream for {request.request_id} ended before its first delta"
            ) from None
        except BaseException:
            await stream.aclose()
            raise
        return stream

    @property
    def finished(self) -> bool:
        return self.usage is not None

    def __aiter__(self) -> DeltaStream:
        return self

    async def __anext__(self) -> Delta:
        if self._first is not None:
            delta, self._first = self._first, None
        elif self.finished or self._iterator is None:
            raise StopAsyncIteration
        else:
            delta = await anext(self._iterator)
        if delta.usage is not None:
            self.usage = delta.usage
        return delta

    async def aclose(self) -> None:
        if self._closed:
            return
        self._closed = True
        if not self.finished:
            # Abort first (synchronous): pages are freed even if closing the iterator is interrupted.
            self.engine.abort(self.request.request_id)
        close = getattr(self._iterator, "aclose", None)
        if close is not None:
            await close()


async def open_streams(
    engine: EngineLike, requests: Sequence[GenerationRequest]
) -> list[DeltaStream]:
    """Open every request concurrently; if any fails, close the others and raise its error."""
    results = await asyncio.gather(
        *(DeltaStream.open(engine, r) for r in requests), return_exceptions=True
    )
    streams = [r for r in results if isinstance(r, DeltaStream)]
    failures = [r for r in results if isinstance(r, BaseException)]
    if failures:
        for stream in streams:
            await stream.aclose()
        raise failures[0]
    return streams


async def merge_streams(streams: Sequence[DeltaStream]) -> AsyncIterator[tuple[int, Delta]]:
    """Yield ``(stream index, delta)`` from several streams as deltas arrive.

    Closing the generator cancels the pumps and closes (aborts) every unfinished stream.
    """
    if len(streams) == 1:
        try:
            async for delta in streams[0]:
                yield 0, delta
        finally:
            await streams[0].aclose()
        return
    queue: asyncio.Queue[tuple[int, Delta | BaseException | None]] = asyncio.Queue()

    async def pump(i: int, stream: DeltaStream) -> None:
        try:
            async for delta in stream:
                queue.put_nowait((i, delta))
            queue.put_nowait((i, None))
        except Exception as exc:  # handed to the consumer, which re-raises it
            queue.put_nowait((i, exc))

    tasks = [asyncio.create_task(pump(i, s)) for i, s in enumerate(streams)]
    try:
        remaining = len(streams)
        while remaining:
            i, item = await queue.get()
            if item is None:
                remaining -= 1
            elif isinstance(item, BaseException):
                raise item
            else:
                yield i, item
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        for stream in streams:
            await stream.aclose()
