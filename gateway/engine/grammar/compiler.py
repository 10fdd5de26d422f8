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
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import xgrammar as xgr

from prefixgate.gateway.engine.api import GrammarSpec, InvalidRequestError

logger = logging.getLogger(__name__)

DEFAULT_CACHE_SIZE = 512


@dataclass(slots=True)
class CompileStats:
    hits: int = 0
    misses: int = 0
    compile_seconds: float = 0.0


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

    Args:
        tokenizer: ``vocab_size``, ``id_to_token`` (gateway.engine.tokenizer.Tokenizer).
        vocab_size: the model's logits width (may exceed the tokenizer's vocabulary).
        stop_token_ids: what ends a constrained output once its grammar is complete.
        cache_size: compiled grammars kept (least recently used dropped first).
    """

    def __init__(self, tokenizer: Any, vocab_size: int, stop_token_ids: Sequence[int],
                 *, cache_size: int = DEFAULT_CACHE_SIZE, max_threads: int = 2) -> None:
        self.info = tokenizer_info(tokenizer, vocab_size, stop_token_ids)
        self.vocab_size = self.info.vocab_size
        # xgrammar's own cache is off: ours is keyed by the spec and bounded
        self._compiler = xgr.GrammarCompiler(self.info, max_threads=max_threads,
                                             cache_enabled=False)
        self._cache: OrderedDict[tuple[str, str, str, bool], xgr.CompiledGrammar] = OrderedDict()
        self._cache_size = cache_size
        self._lock = threading.Lock()
        self.stats = CompileStats()

    def compile(self, spec: GrammarSpec, scope: str = "") -> xgr.CompiledGrammar:
        """The compiled grammar of ``spec`` (cached per ``scope``).

        ``scope`` (the tenant): NOTE a cached compile answers in microseconds, a cold one in
        milliseconds, so a shared cache would tell one tenant which schemas another one uses
        (the timing side channel prefix caches close with a tenant salt). Each scope has its
        own entries.

        Raises:
            InvalidRequestError: the engine cannot compile it (``param`` = ``spec.param``).
        """
        key = (scope, *spec.cache_key)
        with self._lock:
            compiled = self._cache.get(key)
            if compiled is not None:
                self._cache.move_to_end(key)
                self.stats.hits += 1
                return compiled
        start = time.perf_counter()
        compiled = self._compile_uncached(spec)
        elapsed = time.perf_counter() - start
        with self._lock:
            self.stats.misses += 1
            self.stats.compile_seconds += elapsed
            self._cache[key] = compiled
            while len(self._cache) > self._cache_size:
                self._cache.popitem(last=False)
        return compiled

    def _compile_uncached(self, spec: GrammarSpec) -> xgr.CompiledGrammar:
        c = self._compiler
        try:
            if spec.kind == "json_schema":
                return c.compile_json_schema(spec.source, any_whitespace=False,
                                             strict_mode=spec.strict)
            if spec.kind == "json_object":
                return c.compile_json_schema('{"type": "object"}', any_whitespace=False,
                                             strict_mode=False)
            if spec.kind == "regex":
                return c.compile_regex(spec.source)
            if spec.kind == "choice":
                options = json.loads(spec.source)
                if not options or not all(isinstance(o, str) and o for o in options):
                    raise ValueError("choice needs a non-empty list of non-empty strings")
                return c.compile_grammar(
                    "root ::= " + " | ".join(json.dumps(o, ensure_ascii=False) for o in options))
            if spec.kind == "ebnf":
                return c.compile_grammar(spec.source)
            if spec.kind == "structural_tag":
                return c.compile_structural_tag(spec.source)
        except (RuntimeError, ValueError, TypeError, RecursionError) as exc:
            raise InvalidRequestError(
                f"the {spec.kind.replace('_', ' ')} cannot be compiled into a grammar: "
                f"{_short(exc)}", param=spec.param, code="invalid_grammar") from exc
        raise InvalidRequestError(f"unknown grammar kind {spec.kind!r}", param=spec.param)


def _short(exc: BaseException, limit: int = 300) -> str:
    # xgrammar's messages start with a C++ file:line prefix; keep what a user can act on
    text = str(exc).strip().splitlines()[-1] if str(exc).strip() else type(exc).__name__
    if "] " in text and text.startswith("["):
        text = text.split("] ", 1)[1]
    return text[:limit]
