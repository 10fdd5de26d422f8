"""One generation stream (a request's choice) as the scheduler sees it. No torch."""

from __future__ import annotations

import enum
import itertools
from dataclasses import dataclass, field
from typing import Any

from prefixgate.cache import HashedBlock
from prefixgate.engine.api import FinishReason, SamplingParams

_seq_counter = itertools.count()


class SeqStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass(slots=True, eq=False)
class Sequence:
    """One choice of one request: the one record of its tokens (cache.sequence.CacheSequence).

    ``token_ids`` = prompt + generated tokens, appended by the scheduler only. The KV of the
    first ``num_computed`` tokens is in the cache; the cache manager sets it, and grows
    ``block_hashes``, while the sequence is live (it keeps only the block table itself).
    """

    request_id: str
    choice: int
    token_ids: list[int]
    num_prompt_tokens: int
    sampling: SamplingParams
    extra_keys: bytes
    tenant: str
    agent: str | None
    seq_id: int = field(default_factory=lambda: next(_seq_counter))
    status: SeqStatus = SeqStatus.WAITING
    num_computed: int = 0
    num_cached_tokens: int | None = None  # prefix hit at first admission (usage.cached_tokens)
    admitted_order: int = -1  # admission counter: preemption takes the latest first
    arrival_time: float = 0.0  # the scheduler's clock when queued (admission's age bound)
    cached_blocks: int = 0  # leading blocks cached at the last look while waiting (a hint)
    num_choices_to_fork: int = 0  # n - 1 children forked once the prompt is computed
    finish_reason: FinishReason | None = None
    # Chained hashes of the leading full blocks of token_ids: KVCacheManager.block_hashes
    # extends them (lazily: on lookup, allocation and when a computed block fills).
    block_hashes: list[HashedBlock] = field(default_factory=list)
    # Speculative decoding (engine/drafter.py): its DraftState, None = never drafts.
    draft: Any = None
    # Engine-side per-sequence state (sampler generator, detokenizer, stop matcher).
    state: Any = None

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def num_uncomputed(self) -> int:
        return len(self.token_ids) - self.num_computed

    def __repr__(self) -> str:
        return (f"Sequence({self.request_id}#{self.choice}, {self.status.value}, "
                f"tokens={len(self.token_ids)}, computed={self.num_computed})")
