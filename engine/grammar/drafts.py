"""Speculative drafts of constrained rows (tool calls, JSON outputs), and the token masks that
verify them.

A tool call is mostly structure its grammar forces: ``<tool_call>\\n{"name": "`` before the
name, ``", "arguments": {"`` after it, every required key and its ``": "``. Those forced tokens
are the draft (xgrammar's jump-forward tokens); where nothing is forced, the n-gram drafter's
proposal is kept up to the first token the grammar rejects. Either way the verifier decides
(sampler.verify), so the output is exactly what decoding one token at a time gives.

Verifying ``k`` drafts needs ``k + 1`` masks: the row after draft ``i`` may only pick what the
grammar allows once drafts ``0..i-1`` are accepted. :func:`draft_bitmask` walks the matcher
through the drafts filling one row each, then rolls it back: the matcher only ever moves
forward through the tokens the sequence emits.
"""

from __future__ import annotations

import functools
import json
import logging
from collections.abc import Sequence

import torch
import xgrammar as xgr

from prefixgate.engine.api import GrammarSpec
from prefixgate.engine.grammar.schema_bounds import has_regex

logger = logging.getLogger("prefixgate.engine")


class GrammarDrafts:
    """The grammar side of one constrained sequence's drafting (``DraftState.grammar``).

    Args:
        matcher: the sequence's matcher, at the state after its last emitted token.
    """

    __slots__ = ("jump_forward", "matcher")

    def __init__(self, matcher: xgr.GrammarMatcher, *, jump_forward: bool = True) -> None:
        self.matcher = matcher
        self.jump_forward = jump_forward

    def constrain(self, proposal: Sequence[int], limit: int) -> list[int]:
        """Up to ``limit`` draft tokens the grammar accepts in a row: the tokens it forces next,
        else ``proposal`` cut at the first token it rejects. Never a token that would end the
        grammar (a stop token ends the request: it is sampled, not drafted). The matcher is
        left where it was. Without ``jump_forward`` (:func:`jump_forward_allowed`) only the
        proposal is walked."""
        try:
            if limit < 1 or self.matcher.is_terminated():
                return []
            forced = self.matcher.find_jump_forward_tokens() if self.jump_forward else []
            candidates = forced if forced else proposal
            return walk(self.matcher, candidates[:limit])
        except Exception:  # noqa: BLE001 - no draft; a broken matcher fails the row when it masks
            logger.warning("drafting from a grammar failed; decoding without drafts", exc_info=True)
            return []


def jump_forward_allowed(spec: GrammarSpec) -> bool:
    """Whether drafts may ask xgrammar for the text ``spec``'s grammar forces next.

    NOTE: ``find_jump_forward_tokens`` runs until the forced text ends, in C++, unbounded: a
    grammar that forces text without end (``root ::= "a" root``, a required self-reference, a
    regex like ``a*[^\\s\\S]``) grows it until the process is killed. So only grammars whose
    forced text is known finite use it: JSON schemas past grammar/schema_bounds.py (no finite
    value is refused there) without a regex, choices, and structural tags whose builder vouches
    for them. User regexes and EBNF draft from the n-gram proposal alone, one token at a time.
    """
    if spec.kind in ("json_object", "choice"):
        return True
    if spec.kind == "structural_tag":
        return spec.forced_text_finite
    if spec.kind == "json_schema":
        return _schema_without_regex(spec.source)
    return False


@functools.lru_cache(maxsize=256)
def _schema_without_regex(source: str) -> bool:
    try:
        return not has_regex(json.loads(source))
    except ValueError:
        return False


def walk(matcher: xgr.GrammarMatcher, tokens: Sequence[int],
         bitmask: torch.Tensor | None = None) -> list[int]:
    """The longest prefix of ``tokens`` that ``matcher`` accepts without terminating; with
    ``bitmask`` (``[len(tokens) + 1, words]``), row ``i`` is filled with the mask after the
    first ``i`` of them. The matcher is rolled back to where it was."""
    accepted: list[int] = []
    try:
        if bitmask is not None:
            matcher.fill_next_token_bitmask(bitmask, 0)
        for token in tokens:
            if not matcher.accept_token(token):
                break
            if matcher.is_terminated():  # a stop token: not a draft
                matcher.rollback(1)
                break
            accepted.append(token)
            if bitmask is not None:
                matcher.fill_next_token_bitmask(bitmask, len(accepted))
    finally:
        if accepted:
            matcher.rollback(len(accepted))
    return accepted


def draft_bitmask(matcher: xgr.GrammarMatcher, drafts: Sequence[int], num_words: int) -> torch.Tensor:
    """``[len(drafts) + 1, num_words]`` int32: row ``i`` allows what the grammar allows after
    drafts ``0..i-1`` (each accepted: :meth:`GrammarDrafts.constrain` made them). A draft the
    matcher no longer accepts leaves its row and those after it empty: the verifier rejects
    there, and a plain sample would have found the same dead end."""
    bitmask = torch.zeros((len(drafts) + 1, num_words), dtype=torch.int32)
    walk(matcher, drafts, bitmask)
    return bitmask
