"""Constrained decoding: grammar specs compiled by xgrammar, one matcher per sequence, and the
bitmasks that keep a constrained row's next token inside its grammar.

The engine's only contact with xgrammar is this package: ``GrammarCompiler.compile(spec)`` (a
cached compile), ``new_matcher(compiled)`` for each sequence, ``TokenMasker`` for the step's
bitmasks; the masks are applied in the sampler by kernels.token_bitmask.
"""

from __future__ import annotations

import xgrammar as xgr

from prefixgate.engine.grammar.compiler import (
    CompileStats,
    GrammarCompiler,
    json_schema_ebnf,
)
from prefixgate.engine.grammar.masker import TokenMasker

Matcher = xgr.GrammarMatcher
CompiledGrammar = xgr.CompiledGrammar


def new_matcher(compiled: CompiledGrammar) -> Matcher:
    """A matcher at the start of ``compiled`` (one per sequence; n > 1 forks get their own)."""
    return xgr.GrammarMatcher(compiled)


__all__ = [
    "CompileStats",
    "CompiledGrammar",
    "GrammarCompiler",
    "Matcher",
    "TokenMasker",
    "json_schema_ebnf",
    "new_matcher",
]
