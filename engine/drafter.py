"""Draft tokens for speculative decoding, looked up in the sequence's own context (prompt-lookup
/ suffix decoding): agents repeat tool names, JSON keys, arguments and whole phrases from their
conversation, which the prompt of every later turn already holds (so "earlier outputs of the
same agent" are in it, and nothing crosses tenants: a sequence only reads its own tokens).

The draft after a context ``... a b c`` is what followed the latest earlier occurrence of its
last ``n``-gram (longest ``n`` first, 4 down to 2). The scheduler verifies it in one forward as
a short chunk over the paged cache; sampler.verify accepts the drafts the model agrees with:
under greedy decoding the longest prefix equal to the argmax, under sampling by rejection
sampling (the proposal is a point mass on the draft, so a draft is kept with its probability
under the request's own sampling distribution). Pure Python, no torch.

Adaptive length: a sequence drafts ``k`` tokens, ``k`` growing by one after a fully accepted
draft and falling to one past the accepted run after a rejection, so a sequence whose drafts
keep missing costs one extra row a step at most, and one whose context has no match costs
nothing.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Protocol

NGRAM_SIZES = (4, 3, 2)


class DraftConstraint(Protocol):
    """What a constrained sequence may draft (engine/grammar/drafts.GrammarDrafts)."""

    def constrain(self, proposal: Sequence[int], limit: int) -> list[int]: ...


@dataclass(slots=True)
class DraftState:
    """Per-sequence lookup index and draft length."""

    k: int
    # a constrained sequence's grammar: its forced tokens are the draft, else the n-gram
    # proposal up to the first token it rejects
    grammar: DraftConstraint | None = None
    # n-gram -> the position right after its latest occurrence (indexed up to ``indexed``)
    index: dict[tuple[int, ...], int] = field(default_factory=dict)
    indexed: int = 0  # n-grams ending before this position are in ``index``


class NgramDrafter:
    """Proposes up to ``max_draft`` tokens per decode step from the sequence's own tokens.

    Args:
        max_draft: the longest draft (the verify chunk is 1 + this many tokens).
        max_model_len: drafts never run past it.
    """

    def __init__(self, max_draft: int, max_model_len: int):
        if max_draft < 1:
            raise ValueError(f"max_draft must be >= 1, got {max_draft}")
        self.max_draft = max_draft
        self.max_model_len = max_model_len
        self.num_proposed = 0
        self.num_accepted = 0
        self.num_drafts = 0  # verify chunks scheduled

    def propose(self, tokens: list[int], state: DraftState, limit: int) -> list[int]:
        """Draft tokens to follow ``tokens`` (at most ``limit``: the request's remaining output)."""
        end = len(tokens)
        limit = min(limit, state.k, self.max_model_len - end - 1)
        if limit < 1:
            return []
        index = state.index
        # NOTE: index only n-grams ending before the last token, so the suffix we look up
        # never finds itself
        for j in range(state.indexed, end - 1):
            for n in NGRAM_SIZES:
                if j + 1 >= n:
                    index[tuple(tokens[j + 1 - n : j + 1])] = j + 1
        state.indexed = max(state.indexed, end - 1)
        proposal: list[int] = []
        for n in NGRAM_SIZES:
            if end < n:
                continue
            start = index.get(tuple(tokens[end - n :]))
            if start is not None:
                proposal = tokens[start : start + limit]
                break
        if state.grammar is not None:
            return state.grammar.constrain(proposal, limit)
        return proposal

    def record(self, state: DraftState, num_proposed: int, num_accepted: int) -> None:
        """The verify of a ``num_proposed`` draft accepted ``num_accepted``: adapt ``k``."""
        self.num_drafts += 1
        self.num_proposed += num_proposed
        self.num_accepted += num_accepted
        if num_accepted == num_proposed:
            state.k = min(self.max_draft, state.k + 1)
        else:
            state.k = max(1, num_accepted + 1)
