"""The engine's grammars: one compiler per model (built on first use, thread-safe), the
step's token masker, and the compile-cache figures for EngineStats."""

from __future__ import annotations

import threading
from typing import Any

from prefixgate.engine.api import GrammarSpec
from prefixgate.engine.config import EngineConfig
from prefixgate.engine.grammar import CompiledGrammar, GrammarCompiler, TokenMasker
from prefixgate.engine.grammar.worker_pool import CompileLimits

# the grammar compiler is built on first use, from whichever executor thread asks first
_GRAMMARS_LOCK = threading.Lock()


class GrammarService:
    """Compiles output grammars for one tokenizer and masks the step's constrained rows.

    Args:
        tokenizer: the model's tokenizer (``eos_token_ids``, ``visible_special_ids``).
        vocab_size: the model's logits width.
        config: the grammar-compile limits and cache size.
    """

    def __init__(self, tokenizer: Any, vocab_size: int, config: EngineConfig) -> None:
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.config = config
        self._compiler: GrammarCompiler | None = None  # built on the first constrained request
        self._masker: TokenMasker | None = None

    @property
    def compiler(self) -> GrammarCompiler:
        """The grammar compiler for this model's tokenizer (thread-safe; built on first use)."""
        with _GRAMMARS_LOCK:  # executor threads compile concurrently: build it once
            if self._compiler is None:
                self._compiler = self._new_compiler()
        return self._compiler

    def compile(self, spec: GrammarSpec, tenant: str = "default") -> CompiledGrammar:
        """Compile (or fetch from ``tenant``'s cache) ``spec``; InvalidRequestError if it cannot."""
        return self.compiler.compile(spec, tenant)

    def masker(self) -> TokenMasker:
        """The step's token masker (built on first use)."""
        if self._masker is None:
            self._masker = TokenMasker(self.compiler.vocab_size)
        return self._masker

    def close(self) -> None:
        """Stop the grammar-compile workers (a later constrained request starts new ones)."""
        if self._compiler is not None:
            self._compiler.close()

    def _new_compiler(self) -> GrammarCompiler:
        config = self.config
        limits = CompileLimits(timeout_s=config.grammar_compile_timeout_s,
                               memory_bytes=int(config.grammar_compile_memory_gb * (1 << 30)),
                               max_workers=config.grammar_workers)
        # NOTE: a stop token the output's structure writes as text (harmony's <|call|> and
        # <|return|>, engine/tokenizer.py) is the grammar's to place, so xgrammar must not
        # treat it as a stop; the engine still stops on it
        eos = frozenset(getattr(self.tokenizer, "eos_token_ids", ()))
        visible = frozenset(getattr(self.tokenizer, "visible_special_ids", ()))
        return GrammarCompiler(self.tokenizer, self.vocab_size, sorted(eos - visible),
                               limits=limits, cache_bytes=int(config.grammar_cache_mb * (1 << 20)))

    def stats(self) -> dict[str, float]:
        """Compile-cache figures for EngineStats (zeros before the first grammar)."""
        stats = self._compiler.stats if self._compiler is not None else None
        return {
            "grammar_compiles": stats.misses if stats else 0,
            "grammar_cache_hits": stats.hits if stats else 0,
            "grammar_compile_seconds": stats.compile_seconds if stats else 0.0,
            "grammar_limit_failures": stats.limit_failures if stats else 0,
            "grammar_cache_bytes": self._compiler.cache.num_bytes if self._compiler else 0,
        }
