"""Grammar compilation in worker processes, bounded in time and memory.

Each compile runs in a worker process (worker.py) whose address space is capped at start-up
plus ``CompileLimits.memory_bytes``; the caller waits at most ``timeout_s`` and then kills the
worker. Either way the request gets a 400 naming the limit (``grammar_too_complex``), the
server's own memory and its other requests are untouched, and the next compile starts a fresh
worker. Workers start on demand, up to ``max_workers`` at a time, and stay for the next
compile; a caller finding all of them busy for ``queue_timeout_s`` gets a 429.
"""

from __future__ import annotations

import hashlib
import logging
import os
import re
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from typing import Any

from prefixgate.engine.api import InvalidRequestError, OverloadedError
from prefixgate.engine.grammar.frames import FrameTimeout, read_frame_until, write_frame

logger = logging.getLogger(__name__)

# "[12:00:00] /project/cpp/regex_converter.cc:94: " before xgrammar's own words
_SOURCE_PREFIX = re.compile(r"^(\[[^\]]*\]\s*)?(\S+\.(cc|h|cpp):\d+:\s*)?")
# importing xgrammar (and torch with it) on a busy 2-core machine has taken over 10 s
_START_TIMEOUT_S = 120.0


@dataclass(frozen=True, slots=True)
class CompileLimits:
    """What one grammar compile may take (``--grammar-compile-*`` flags).

    Attributes:
        timeout_s: wall time of one compile in its worker.
        memory_bytes: memory a worker may map beyond what it held once xgrammar was loaded.
        max_workers: worker processes at most; 0 compiles in the calling thread, unbounded
            (tests of grammar logic, never the server).
        threads: xgrammar's threads per compile.
        queue_timeout_s: how long a caller waits for a free worker before its 429; None =
            ``timeout_s`` (time for the compile ahead of it to finish or be killed).
    """

    timeout_s: float = 10.0
    memory_bytes: int = 2 << 30
    max_workers: int = 2
    threads: int = 1
    queue_timeout_s: float | None = None


class CompileLimitError(InvalidRequestError):
    """A compile ran past its time or memory limit (HTTP 400, ``grammar_too_complex``)."""


@dataclass(frozen=True, slots=True)
class CompileResult:
    """One worker compile: the serialized grammar and what it cost."""

    grammar_json: str
    seconds: float
    peak_rss_bytes: int
    # with ``probe_steps``: the longest text the grammar forced along the probe's walk
    forced_chars: int | None = None


class _Worker:
    """One worker process and its pipes."""

    def __init__(self, hello: dict[str, Any], generation: int) -> None:
        self.generation = generation
        env = {**os.environ, "OMP_NUM_THREADS": "1"}
        self.process = subprocess.Popen(
            [sys.executable, "-m", "prefixgate.engine.grammar.worker"],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, env=env, close_fds=True)
        assert self.process.stdin is not None and self.process.stdout is not None
        self._stdin = self.process.stdin
        self._stdout_fd = self.process.stdout.fileno()
        try:
            self.call(hello, _START_TIMEOUT_S)
        except BaseException:
            self.kill()
            raise

    def call(self, message: dict[str, Any], timeout_s: float) -> dict[str, Any]:
        """Send one message, wait for its answer.

        Raises:
            FrameTimeout: no answer in time.
            EOFError: the worker died (killed by the kernel, a crash).
        """
        try:
            write_frame(self._stdin, message)
        except (BrokenPipeError, OSError) as exc:
            raise EOFError("the grammar worker is gone") from exc
        reply = read_frame_until(self._stdout_fd, time.monotonic() + timeout_s)
        if reply is None:
            raise EOFError("the grammar worker exited")
        return reply

    def kill(self) -> None:
        if self.process.poll() is None:
            self.process.kill()
        try:
            self.process.wait(timeout=5)
        except subprocess.TimeoutExpired:
            logger.warning("grammar worker %d did not exit after SIGKILL", self.process.pid)
        for stream in (self.process.stdin, self.process.stdout):
            if stream is not None:
                try:
                    stream.close()
                except OSError:
                    logger.debug("closing a grammar worker pipe failed", exc_info=True)


class CompileWorkerPool:
    """Compiles grammar specs in worker processes under :class:`CompileLimits`.

    Args:
        tokenizer_info_json: ``xgr.TokenizerInfo.serialize_json()`` of the model's tokenizer.
        limits: time, memory and worker bounds.
    """

    def __init__(self, tokenizer_info_json: str, limits: CompileLimits) -> None:
        self.limits = limits
        self._hello = {"tokenizer_info": tokenizer_info_json, "threads": limits.threads,
                       "memory_bytes": limits.memory_bytes}
        self._idle: list[_Worker] = []
        self._num_workers = 0
        self._num_starting = 0  # of them, still loading xgrammar
        # close() bumps it: a worker of an earlier generation is stopped when it comes back
        self._generation = 0
        self._cond = threading.Condition()
        self.num_timeouts = 0
        self.num_memory_failures = 0
        self.num_restarts = 0

    def compile(self, kind: str, source: str, strict: bool, param: str,
                *, probe_steps: int = 0) -> CompileResult:
        """Compile one spec in a worker; the serialized grammar and its cost.

        ``probe_steps`` (tests, benchmarks): then also walk the grammar that many steps as
        drafting would, in the worker and under its limits (worker.py ``_probe``).

        Raises:
            CompileLimitError: over the time or memory limit (``param`` named).
            InvalidRequestError: xgrammar refused the spec (``invalid_grammar``).
            OverloadedError: every worker stayed busy for ``timeout_s``.
        """
        try:
            worker = self._acquire()
        except (EOFError, FrameTimeout, OSError) as exc:
            logger.error("a grammar-compile worker could not be started", exc_info=True)
            raise OverloadedError("the grammar compiler could not be started; retry shortly",
                                  retry_after=5.0) from exc
        keep = False
        try:
            reply = worker.call({"kind": kind, "source": source, "strict": strict,
                                 "probe_steps": probe_steps}, self.limits.timeout_s)
            # after an allocation failed a worker starts afresh (xgrammar's state may not)
            keep = not reply.get("memory")
        except FrameTimeout:
            self.num_timeouts += 1
            raise CompileLimitError(
                f"compiling the {kind.replace('_', ' ')} took longer than the limit of "
                f"{self.limits.timeout_s:g} s (--grammar-compile-timeout)", param=param,
                code="grammar_too_complex") from None
        except EOFError:
            self.num_memory_failures += 1
            raise self._memory_error(kind, param) from None
        finally:
            self._release(worker, keep)
        if not reply.get("ok"):
            if reply.get("memory"):
                self.num_memory_failures += 1
                raise self._memory_error(kind, param)
            raise InvalidRequestError(
                f"the {kind.replace('_', ' ')} cannot be compiled into a grammar: "
                f"{short_error(str(reply.get('error', '')))}", param=param, code="invalid_grammar")
        return CompileResult(reply["grammar"], float(reply.get("seconds", 0.0)),
                             int(reply.get("peak_rss", 0)), reply.get("forced_chars"))

    def _memory_error(self, kind: str, param: str) -> CompileLimitError:
        return CompileLimitError(
            f"compiling the {kind.replace('_', ' ')} needed more than the limit of "
            f"{_size(self.limits.memory_bytes)} (--grammar-compile-memory)",
            param=param, code="grammar_too_complex")

    def start(self) -> None:
        """Start one worker now (the first compile then skips the interpreter start)."""
        try:
            self._release(self._acquire(), True)
        except (OverloadedError, OSError, EOFError, FrameTimeout):
            logger.warning("the grammar worker could not be started ahead of time", exc_info=True)

    def close(self) -> None:
        """Stop every idle worker; busy ones are stopped as they come back. A later compile
        starts a new worker."""
        with self._cond:
            self._generation += 1
            idle, self._idle = self._idle, []
            self._num_workers -= len(idle)
            self._cond.notify_all()
        for worker in idle:
            worker.kill()

    @property
    def num_workers(self) -> int:
        """Worker processes alive now (idle or compiling)."""
        return self._num_workers

    def _acquire(self) -> _Worker:
        wait = self.limits.queue_timeout_s
        deadline = time.monotonic() + (self.limits.timeout_s if wait is None else wait)
        with self._cond:
            while not self._idle and self._num_workers >= self.limits.max_workers:
                left = deadline - time.monotonic()
                if left <= 0 and self._num_starting:
                    left = 0.1  # a worker still starting is not a busy one: wait for it
                elif left <= 0:
                    raise OverloadedError(
                        "every grammar compiler is busy; retry shortly", retry_after=1.0)
                self._cond.wait(left)
            if self._idle:
                return self._idle.pop()
            self._num_workers += 1
            self._num_starting += 1
            generation = self._generation
        try:
            return _Worker(self._hello, generation)
        except BaseException:
            with self._cond:
                self._num_workers -= 1
                self._cond.notify()
            raise
        finally:
            with self._cond:
                self._num_starting -= 1

    def _release(self, worker: _Worker, keep: bool) -> None:
        with self._cond:
            if keep and worker.generation == self._generation:
                self._idle.append(worker)
                self._cond.notify()
                return
            self._num_workers -= 1
            self._cond.notify()
            replace = not keep and worker.generation == self._generation
            if replace:
                self.num_restarts += 1
        worker.kill()
        if replace:  # the next caller should not wait for an interpreter to start
            threading.Thread(target=self._restart, args=(worker.generation,),
                             name="prefixgate-grammar-restart", daemon=True).start()

    def _restart(self, generation: int) -> None:
        if generation == self._generation:  # not after close()
            self.start()


def _size(num_bytes: int) -> str:
    return (f"{num_bytes / (1 << 30):g} GiB" if num_bytes >= 1 << 30
            else f"{num_bytes / (1 << 20):g} MiB")


def short_error(text: str, limit: int = 300) -> str:
    """xgrammar's message without its C++ ``[file:line]`` prefix, cut to ``limit``."""
    text = text.strip().splitlines()[-1] if text.strip() else "unknown error"
    return _SOURCE_PREFIX.sub("", text)[:limit]


_SHARED: dict[tuple[str, CompileLimits], CompileWorkerPool] = {}
_SHARED_LOCK = threading.Lock()


def shared_pool(tokenizer_info_json: str, limits: CompileLimits) -> CompileWorkerPool:
    """The process's pool for one vocabulary and one set of limits: engines over the same model
    (a test session's, an embedding program's) share its workers instead of each starting its
    own interpreters."""
    key = (hashlib.sha256(tokenizer_info_json.encode()).hexdigest(), limits)
    with _SHARED_LOCK:
        pool = _SHARED.get(key)
        if pool is None:
            pool = _SHARED[key] = CompileWorkerPool(tokenizer_info_json, limits)
        return pool
