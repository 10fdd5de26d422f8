"""The async engine the gateway talks to (implements engine.api.EngineLike).

One background thread owns the LLMEngine and drives its steps; the HTTP event loop only
enqueues commands and awaits deltas, so a forward pass never blocks it. Deltas cross back with
``loop.call_soon_threadsafe``, once per loop per step (``_flush_outbox``), not once per delta.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
import time
from collections import deque
from collections.abc import AsyncIterator, Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from prefixgate.cache.events import EventSink
from prefixgate.cache.hashing import HashedBlock
from prefixgate.cache.stats import CacheStats
from prefixgate.engine.api import (
    Delta,
    EngineError,
    EngineStats,
    GenerationRequest,
    PinResult,
    SamplingParams,
    new_request_id,
)
from prefixgate.engine.config import EngineConfig
from prefixgate.engine.engine_core import LLMEngine
from prefixgate.engine.validation import check_queue

logger = logging.getLogger("prefixgate.engine")


class AsyncEngine:
    """Thread-driven front of :class:`LLMEngine`.

    Args:
        core: the synchronous engine (owned by the engine thread from ``start()`` on).
        model_name: served model name.
        device, kernel_backend, dtype, kv_dtype: reported in stats (and the precisions in
            /v1/models).
    """

    def __init__(self, core: LLMEngine, *, model_name: str, device: str = "cpu",
                 kernel_backend: str = "torch", dtype: str = "float32", kv_dtype: str = "float32"):
        self.core = core
        self.model_name = model_name
        self.max_model_len = core.max_model_len
        self.tokenizer = core.tokenizer
        self.device = device
        self.kernel_backend = kernel_backend
        self.dtype, self.kv_dtype = dtype, kv_dtype
        # What a router needs to recompute this replica's block hashes (see gateway/scaleout).
        self.model_id = core.model_id
        self.page_size = core.page_size
        self.hash_seed = core.config.hash_seed
        # Guards the core: the engine thread holds it for a step; stats/pin calls take it briefly.
        self._lock = threading.Lock()
        self._lock_waiters = 0  # callers queued for the lock (the engine thread yields to them)
        self._inbox: deque[Callable[[], None]] = deque()
        self._wake = threading.Condition()
        self._thread: threading.Thread | None = None
        self._stopping = False
        self._num_queued = 0  # submitted but not yet handed to the core (for the overload check)
        # what the engine thread's commands and step produced for the event loops: handed over
        # together once they are done (_flush_outbox)
        self._outbox: list[tuple[asyncio.AbstractEventLoop, Callable[[Any], None], Any]] = []
        # grammar compiles wait on their worker processes here, not in the loop's default
        # executor: compiles held to their time limit leave the threads other work uses free
        self._compile_threads = ThreadPoolExecutor(
            max_workers=4 * core.config.grammar_workers, thread_name_prefix="prefixgate-grammar")

    # ------------------------------------------------------------------ lifecycle

    async def start(self) -> None:
        self.start_sync()

    def warm_grammars(self) -> None:
        """Start a grammar-compile worker in the background, so that the first constrained
        request does not wait for its interpreter (``prefixgate serve`` does, once ready)."""
        threading.Thread(target=self.core.grammars.compiler.start, name="prefixgate-grammar-warmup",
                         daemon=True).start()

    def start_sync(self) -> None:
        if self._thread is not None:
            return
        self._stopping = False
        self._thread = threading.Thread(target=self._run, name="prefixgate-engine", daemon=True)
        self._thread.start()

    async def shutdown(self) -> None:
        self.shutdown_sync()

    def shutdown_sync(self) -> None:
        with self._wake:
            self._stopping = True
            self._wake.notify()
        if self._thread is not None:
            self._thread.join(timeout=30)
            self._thread = None
        self.core.grammars.close()

    @contextlib.contextmanager
    def _shared(self) -> Iterator[None]:
        """Hold the core lock from a non-engine thread, without being starved by the engine."""
        with self._wake:
            self._lock_waiters += 1
        try:
            self._lock.acquire()
        finally:
            with self._wake:
                self._lock_waiters -= 1
        try:
            yield
        finally:
            self._lock.release()

    def _post(self, command: Callable[[], None]) -> None:
        with self._wake:
            self._inbox.append(command)
            self._wake.notify()

    def _run(self) -> None:
        while True:
            with self._wake:
                while not self._inbox and not self._stopping and not self.core.has_work():
                    self._wake.wait()
                if self._stopping:
                    break
                commands = list(self._inbox)
                self._inbox.clear()
            with self._lock:
                for command in commands:
                    try:
                        command()
                    except Exception:  # one bad add/abort must not kill the engine thread
                        logger.exception("an engine command failed")
                if self.core.has_work():
                    try:
                        # a failure attributable to one request fails it alone inside step()
                        self.core.step()
                    except Exception:  # the model or device itself: must not kill the server
                        logger.exception("engine step failed; failing in-flight requests")
                        try:
                            self.core.recover(EngineError("internal error in the engine step"))
                        except Exception:
                            logger.exception("recovering from a failed step failed")
            self._flush_outbox()
            if self._lock_waiters:
                # NOTE: threading.Lock is not fair: released and re-taken at once, a busy engine
                # would starve stats/pin callers for many steps. Step aside briefly for them.
                time.sleep(0.0005)
        with self._lock:
            self.core.fail_all(EngineError("the engine is shutting down", code="shutdown"))
        self._flush_outbox()

    def _send(self, loop: asyncio.AbstractEventLoop, callback: Callable[[Any], None], item: Any) -> None:
        """Have ``loop`` call ``callback(item)``: after the engine thread's current step (or
        commands) when called there, at once from any other thread."""
        if threading.current_thread() is self._thread:
            self._outbox.append((loop, callback, item))
        else:
            _deliver(loop, callback, item)

    def _flush_outbox(self) -> None:
        """Hand everything the last commands and step produced to its event loops: one wakeup
        per loop, the fan-out to the requests' queues runs in the loop.

        NOTE: a wakeup per delta (call_soon_threadsafe writes the loop's self-pipe) woke the
        loop in the middle of the step, 16 times a step at batch 16, and the loop thread then
        took the GIL from the step's remaining Python for every one of them.
        """
        if not self._outbox:
            return
        items, self._outbox = self._outbox, []
        by_loop: dict[asyncio.AbstractEventLoop, list[tuple[Callable[[Any], None], Any]]] = {}
        for loop, callback, item in items:
            by_loop.setdefault(loop, []).append((callback, item))
        for loop, calls in by_loop.items():
            _deliver(loop, _call_each, calls)

    # ------------------------------------------------------------------ requests

    async def generate(self, request: GenerationRequest) -> AsyncIterator[Delta]:
        """Stream deltas. Errors known up front raise before the first delta.

        Validation and the queue-full check run here, once: the engine thread only queues."""
        self.core.validate(request)
        with self._wake:
            check_queue(self._num_queued + self.core.scheduler.num_waiting,
                        self.core.config.max_waiting)
            # counted from here: a request still compiling its grammar holds its place in the
            # queue, or a burst of cold schemas would all pass the check while they compile
            self._num_queued += 1
        loop = asyncio.get_running_loop()
        try:
            grammar = await self._compile(loop, request)
        except BaseException:
            with self._wake:
                self._num_queued -= 1
            raise
        queue: asyncio.Queue[Delta | EngineError] = asyncio.Queue()

        def sink(item: Delta | EngineError) -> None:
            self._send(loop, queue.put_nowait, item)

        def add() -> None:
            with self._wake:
                self._num_queued -= 1
            try:
                self.core.enqueue(request, sink, grammar=grammar)
            except EngineError as exc:
                sink(exc)
            except Exception:  # e.g. a grammar matcher that cannot start: this request only
                logger.exception("adding request %s failed", request.request_id)
                sink(EngineError("the request could not be started", code="request_failed"))

        self._post(add)
        done = False
        try:
            while True:
                item = await queue.get()
                if isinstance(item, EngineError):
                    done = True
                    raise item
                if item.usage is not None:
                    done = True
                yield item
                if done:
                    return
        finally:
            if not done:  # client gone or cancelled: free the pages now
                self.abort(request.request_id)

    async def _compile(self, loop: asyncio.AbstractEventLoop, request: GenerationRequest) -> Any:
        """The request's grammar, compiled off the engine thread (a cold schema takes
        milliseconds, a cached one microseconds); one that cannot compile fails before the
        first delta. None without a grammar."""
        if request.grammar is None:
            return None
        return await loop.run_in_executor(self._compile_threads, self.core.grammars.compile,
                                          request.grammar, request.tenant)

    def abort(self, request_id: str) -> None:
        self._post(lambda: self.core.abort(request_id))

    def finish_early(self, request_id: str) -> None:
        """End the request as if it stopped: its stream gets finish "stop" and usage."""
        self._post(lambda: self.core.finish_early(request_id))

    async def complete(self, request: GenerationRequest) -> list[Delta]:
        """Collect every delta of a request (non-streaming callers)."""
        return [d async for d in self.generate(request)]

    # ------------------------------------------------------------------ cache control

    async def pin(self, token_ids: Sequence[int], tenant: str, cache_salt: str | None = None) -> PinResult:
        """Compute the prompt's full blocks if needed and keep them resident."""
        ids = tuple(token_ids)
        # Computing the prompt caches its full blocks; they are pinned as the request finishes,
        # before its pages are released (same engine thread, so nothing can evict in between).
        request = GenerationRequest(ids, SamplingParams(max_tokens=1, temperature=0),
                                    tenant=tenant, cache_salt=cache_salt, request_id=new_request_id("pin"))
        loop = asyncio.get_running_loop()
        done: asyncio.Future[None] = loop.create_future()

        def sink(item: Delta | EngineError) -> None:
            if isinstance(item, EngineError):
                self._send(loop, lambda e: _settle(done, e), item)
            elif item.usage is not None:
                self._send(loop, lambda e: _settle(done, e), None)

        def add() -> None:
            try:
                self.core.add_request(request, sink, pin_when_done=True)
            except EngineError as exc:
                sink(exc)

        self._post(add)
        await done
        return await asyncio.to_thread(self._pinned_result, ids, tenant, cache_salt)

    async def unpin(self, token_ids: Sequence[int], tenant: str, cache_salt: str | None = None) -> PinResult:
        ids = tuple(token_ids)

        def unpin_locked() -> int:  # waits for the engine lock: off the event loop
            with self._shared():
                return self.core.kv.unpin(ids, self.core.extra_keys_for(tenant, cache_salt))

        pages = await asyncio.to_thread(unpin_locked)
        return PinResult(num_tokens=pages * self.core.page_size, num_pages=pages)

    async def retain(self, token_ids: Sequence[int], tenant: str, cache_salt: str | None,
                     ttl_s: float) -> int:
        """Keep the cached full blocks of ``token_ids`` ahead of LRU eviction for ``ttl_s``
        (soft: see cache/retention.py), within the pool's retention budget and ``tenant``'s
        share of it (``EngineConfig.retention_tenant_budget``); returns pages."""
        ids = tuple(token_ids)
        num_pages = self.core.kv.num_pages
        budget = int(num_pages * self.core.config.retention_budget)
        tenant_budget = int(num_pages * self.core.config.retention_tenant_budget)

        def retain_locked() -> int:  # waits for the engine lock: off the event loop
            with self._shared():
                return self.core.kv.retain(ids, self.core.extra_keys_for(tenant, cache_salt),
                                           ttl_s, max_pages=budget, tenant=tenant,
                                           max_tenant_pages=tenant_budget)

        return await asyncio.to_thread(retain_locked)

    def _pinned_result(self, ids: tuple[int, ...], tenant: str, cache_salt: str | None) -> PinResult:
        with self._shared():
            n = self.core.kv.num_pinned_prefix_pages(ids, self.core.extra_keys_for(tenant, cache_salt))
        return PinResult(num_tokens=n * self.core.page_size, num_pages=n)

    def reset_cache(self) -> int:
        with self._shared():
            return self.core.kv.reset()

    # ------------------------------------------------------------------ stats

    def cache_stats(self) -> CacheStats:
        with self._shared():
            return self.core.kv.stats()

    def engine_stats(self) -> EngineStats:
        with self._shared():
            core = self.core
            return EngineStats(
                num_running=core.scheduler.num_running,
                num_waiting=core.scheduler.num_waiting + self._num_queued,
                max_waiting=core.config.max_waiting,
                prefill_tokens_computed=core.prefill_tokens_computed,
                decode_tokens=core.decode_tokens,
                num_preemptions=core.scheduler.num_preemptions,
                kernel_backend=self.kernel_backend,
                device=self.device,
                dtype=self.dtype,
                kv_dtype=self.kv_dtype,
                constrained_tokens=core.constrained_tokens,
                **core.grammars.stats(),
                tier=core.tier_stats(),
                **core.spec_stats(),
            )

    # ------------------------------------------------------------------ scale-out index

    def add_event_sink(self, sink: EventSink) -> None:
        """Also send BlockStored / BlockRemoved to ``sink`` (called from the engine thread).

        Attaching late misses earlier events: follow with :meth:`cached_block_hashes`.
        """
        with self._shared():
            self.core.kv.add_event_sink(sink)

    def load_estimate(self) -> tuple[int, int, int, int]:
        """(running, waiting, free pages, steps taken), read WITHOUT the engine lock.

        A step holds the lock for as long as it runs and Python locks are not fair, so a
        locked snapshot can wait many steps under load; heartbeats read these counters instead
        (each is exact at some recent instant; together they may be a step apart).
        """
        core = self.core
        return (core.scheduler.num_running, core.scheduler.num_waiting + self._num_queued,
                core.kv.num_free_pages, core.num_steps)

    def tier_facts(self) -> tuple[str, float | None]:
        """(the second tier's store name, "" without one; its measured load discount, see
        LLMEngine.tier_load_discount), read without the engine lock like load_estimate."""
        core = self.core
        name = core.tier.store.name if core.tier is not None else ""
        return name, core.tier_load_discount()

    def cached_block_hashes(self) -> list[bytes]:
        """Every block hash hittable on this replica right now (a full index resync)."""
        with self._shared():
            return self.core.kv.cached_hashes()

    def cached_blocks(self) -> list[HashedBlock]:
        """Every hittable block with its parent, token ids and extra keys, parents before
        children where both are cached (a KV-events snapshot: gateway/scaleout/kv_events)."""
        with self._shared():
            return self.core.kv.cached_blocks()

    def wait_idle(self, timeout: float = 60.0) -> bool:
        """Block until no request is in flight (tests and benchmarks)."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            with self._shared():
                if not self.core.has_work() and not self._inbox and self.core.num_requests == 0:
                    return True
            time.sleep(0.01)
        return False


def _deliver(loop: asyncio.AbstractEventLoop, callback: Callable[[Any], None], item: Any) -> None:
    """Hand ``item`` to an event loop from the engine thread.

    The caller's loop may be gone (client process shutting down, a test's asyncio.run ended);
    the request's abort is already queued then, so the item is dropped — it must not take the
    engine thread down with it.
    """
    try:
        loop.call_soon_threadsafe(callback, item)
    except RuntimeError:  # "Event loop is closed"
        logger.debug("dropped a delta for a closed event loop")


def _call_each(calls: list[tuple[Callable[[Any], None], Any]]) -> None:
    """In the event loop: one engine step's deliveries, each on its own (one that raises
    loses its item alone)."""
    for callback, item in calls:
        try:
            callback(item)
        except Exception:
            logger.exception("delivering an engine result failed")


def _settle(future: asyncio.Future[Any], error: EngineError | None) -> None:
    if future.done():
        return
    if error is None:
        future.set_result(None)
    else:
        future.set_exception(error)


def build_engine(config: EngineConfig | None = None, *, event_sink=None, loaded=None,
                 tier_store=None) -> AsyncEngine:
    """Load the model (progress bar), size the KV pool, and return a ready-to-start engine.

    ``loaded`` reuses an already loaded model (a LoadedModel: tests share one across engines).
    """
    from prefixgate.engine.build import create_llm_engine

    config = config or EngineConfig()
    core, info = create_llm_engine(config, event_sink=event_sink, loaded=loaded, tier_store=tier_store)
    logger.info("engine ready: model=%s device=%s %s (KV %s) kernels=%s%s pages=%d x %d tokens, "
                "step budget %d tokens",
                info["model_name"], info["device"], info["dtype"], info["kv_dtype"],
                info["kernel_backend"], " + native CPU kernels" if info.get("native_cpu_kernels") else "",
                core.kv.num_pages, core.page_size, core.scheduler.max_num_batched_tokens)
    return AsyncEngine(core, model_name=info["model_name"], device=info["device"],
                       kernel_backend=info["kernel_backend"], dtype=info["dtype"],
                       kv_dtype=info["kv_dtype"])
