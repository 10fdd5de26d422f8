"""Grammar specs → compiled xgrammar grammars, once per distinct spec (an LRU cache).

Why xgrammar: its per-step bitmask fill (one row, and a batch through its batch matcher) was
an order of magnitude cheaper than llguidance's on SmolLM2's 49,152-token vocabulary, and the
mask is paid every constrained step; llguidance compiles lazily (a quicker first mask), but a
swarm repeats a handful of schemas, which the cache below makes free after the first request
(figures: docs/benchmarks.md, "Measurements behind code choices").
xgrammar also brings structural tags (free text, then a triggered tool-call tag), which is
exactly ``tool_choice="auto"``.

JSON is generated in ONE canonical form: no free whitespace, ``", "`` and ``": "`` separators,
properties in schema order (``json.dumps`` with default separators writes the same text), so a
tool call re-rendered into the next turn's prompt is byte-identical to what was generated.
"""

from __future__ import annotations

import json
import logging
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import xgrammar as xgr

from prefixgate.engine.api import GrammarSpec, InvalidRequestError
from prefixgate.engine.grammar.schema_bounds import check_schema_bounds
from prefixgate.engine.grammar.scoped_cache import ScopedLRUCache
from prefixgate.engine.grammar.worker_pool import (
    CompileLimits,
    CompileWorkerPool,
    shared_pool,
    short_error,
)

logger = logging.getLogger(__name__)

# compiled grammars kept, in bytes (xgrammar's own measure of each); one tenant at most half
DEFAULT_CACHE_BYTES = 256 << 20


@dataclass(slots=True)
class CompileStats:
    hits: int = 0
    misses: int = 0
    compile_seconds: float = 0.0
    # compiles refused for a limit (time, memory; the worker pool counts which)
    limit_failures: int = 0
    # the most memory one worker compile took (its process's peak RSS)
    peak_compile_rss_bytes: int = 0


def json_schema_ebnf(schema: dict[str, Any] | bool, *, strict: bool = True) -> str:
    """The canonical-JSON grammar of ``schema`` as EBNF text (embeddable in a structural tag)."""
    return str(xgr.Grammar.from_json_schema(json.dumps(schema), any_whitespace=False,
                                            strict_mode=strict))


def _vocab_type(tokenizer: Any) -> xgr.VocabType:
    """Byte-level BPE spells bytes as GPT-2 characters; sentencepiece uses <0xNN> fallbacks."""
    backend = getattr(tokenizer, "backend", None)
    if backend is not None:
        try:
            metadata = xgr.TokenizerInfo._detect_metadata_from_hf(backend.to_str())
            return xgr.VocabType(metadata["vocab_type"])
        except Exception:  # noqa: BLE001 - detection is a heuristic; fall back to the spelling
            logger.debug("xgrammar could not detect the vocabulary type", exc_info=True)
    return xgr.VocabType.BYTE_LEVEL


def tokenizer_info(tokenizer: Any, vocab_size: int, stop_token_ids: Sequence[int]) -> xgr.TokenizerInfo:
    """xgrammar's view of our tokenizer: every token's stored spelling, padded to the model's
    logits width (ids past the tokenizer's vocabulary are never allowed)."""
    size = tokenizer.vocab_size
    encoded = [tokenizer.id_to_token(i) or "" for i in range(size)]
    return xgr.TokenizerInfo(encoded, _vocab_type(tokenizer), vocab_size=max(vocab_size, size),
                             stop_token_ids=list(stop_token_ids))


class GrammarCompiler:
    """Compiles :class:`GrammarSpec` records for one tokenizer; thread-safe, cached.

    Compilation runs in worker processes bounded in time and memory (worker_pool.py): a spec
    that would stall or exhaust the server gets a 400 naming the limit instead. JSON schemas are
    checked up front first (schema_bounds.py): one no finite value satisfies never compiles.

    Args:
        tokenizer: ``vocab_size``, ``id_to_token`` (engine.tokenizer.Tokenizer).
        vocab_size: the model's logits width (may exceed the tokenizer's vocabulary).
        stop_token_ids: what ends a constrained output once its grammar is complete.
        limits: per-compile time/memory and the worker count (``max_workers`` 0: compile in
            the calling thread, unbounded; for tests of grammar logic only).
        cache_bytes: compiled grammars kept, in bytes; one tenant holds at most half.
    """

    def __init__(self, tokenizer: Any, vocab_size: int, stop_token_ids: Sequence[int],
                 *, limits: CompileLimits | None = None,
                 cache_bytes: int = DEFAULT_CACHE_BYTES) -> None:
        self.info = tokenizer_info(tokenizer, vocab_size, stop_token_ids)
        self.vocab_size = self.info.vocab_size
        self.limits = limits or CompileLimits()
        self._pool: CompileWorkerPool | None = None
        self._local: xgr.GrammarCompiler | None = None
        if self.limits.max_workers > 0:
            self._pool = shared_pool(self.info.serialize_json(), self.limits)
        else:  # xgrammar's own cache is off: ours is keyed by the spec and bounded
            self._local = xgr.GrammarCompiler(self.info, max_threads=self.limits.threads,
                                              cache_enabled=False)
        self.cache: ScopedLRUCache[xgr.CompiledGrammar] = ScopedLRUCache(cache_bytes)
        self._lock = threading.Lock()
        self.stats = CompileStats()

    @property
    def pool(self) -> CompileWorkerPool | None:
        """The worker processes (None when compiling in-process)."""
        return self._pool

    def start(self) -> None:
        """Start a compile worker ahead of the first constrained request."""
        if self._pool is not None:
            self._pool.start()

    def close(self) -> None:
        """Stop the compile workers (shared with every compiler of the same vocabulary and
        limits: they start again on the next compile)."""
        if self._pool is not None:
            self._pool.close()

    def compile(self, spec: GrammarSpec, scope: str = "") -> xgr.CompiledGrammar:
        """The compiled grammar of ``spec`` (cached per ``scope``).

        ``scope`` (the tenant): NOTE a cached compile answers in microseconds, a cold one in
        milliseconds, so a shared cache would tell one tenant which schemas another one uses
        (the timing side channel prefix caches close with a tenant salt). Each scope has its
        own entries, and at most half the cache's bytes.

        Raises:
            InvalidRequestError: the engine cannot compile it (``param`` = ``spec.param``);
                ``grammar_too_complex`` when over a compile limit.
            OverloadedError: every compile worker stayed busy.
        """
        compiled = self.cache.get(scope, spec.cache_key)
        if compiled is not None:
            with self._lock:
                self.stats.hits += 1
            return compiled
        start = time.perf_counter()
        compiled, peak_rss = self._compile_uncached(spec)
        elapsed = time.perf_counter() - start
        with self._lock:
            self.stats.misses += 1
            self.stats.compile_seconds += elapsed
            self.stats.peak_compile_rss_bytes = max(self.stats.peak_compile_rss_bytes, peak_rss)
        self.cache.put(scope, spec.cache_key, compiled, compiled.memory_size_bytes)
        return compiled

    def _compile_uncached(self, spec: GrammarSpec) -> tuple[xgr.CompiledGrammar, int]:
        if spec.kind == "json_schema":
            try:
                schema = json.loads(spec.source)
            except ValueError as exc:
                raise InvalidRequestError(f"the JSON schema is not valid JSON: {exc}",
                                          param=spec.param, code="invalid_grammar") from exc
            check_schema_bounds(schema, spec.param)
        if self._local is not None:
            try:
                return compile_spec(self._local, spec.kind, spec.source, spec.strict), 0
            except (RuntimeError, ValueError, TypeError, RecursionError) as exc:
                raise _invalid(spec, exc) from exc
        assert self._pool is not None
        try:
            result = self._pool.compile(spec.kind, spec.source, spec.strict, spec.param)
        except InvalidRequestError as exc:
            if exc.code == "grammar_too_complex":
                with self._lock:
                    self.stats.limit_failures += 1
            raise
        compiled = xgr.CompiledGrammar.deserialize_json(result.grammar_json, self.info)
        return compiled, result.peak_rss_bytes


def compile_spec(compiler: xgr.GrammarCompiler, kind: str, source: str,
                 strict: bool) -> xgr.CompiledGrammar:
    """One spec compiled by ``compiler`` (a worker's, or the in-process one).

    Raises:
        ValueError / RuntimeError: xgrammar refused it (or an unknown kind).
    """
    if kind == "json_schema":
        return compiler.compile_json_schema(source, any_whitespace=False, strict_mode=strict)
    if kind == "json_object":
        return compiler.compile_json_schema('{"type": "object"}', any_whitespace=False,
                                            strict_mode=False)
    if kind == "regex":
        return compiler.compile_regex(source)
    if kind == "choice":
        options = json.loads(source)
        if not options or not all(isinstance(o, str) and o for o in options):
            raise ValueError("choice needs a non-empty list of non-empty strings")
        return compiler.compile_grammar(
            "root ::= " + " | ".join(json.dumps(o, ensure_ascii=False) for o in options))
    if kind == "ebnf":
        return compiler.compile_grammar(source)
    if kind == "structural_tag":
        return compiler.compile_structural_tag(source)
    raise ValueError(f"unknown grammar kind {kind!r}")


def _invalid(spec: GrammarSpec, exc: BaseException) -> InvalidRequestError:
    return InvalidRequestError(
        f"the {spec.kind.replace('_', ' ')} cannot be compiled into a grammar: "
        f"{short_error(str(exc) or type(exc).__name__)}", param=spec.param, code="invalid_grammar")
