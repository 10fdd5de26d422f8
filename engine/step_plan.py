"""The records of one step being planned and planned: the chunks the model computes
(``ScheduledChunk``, also the runner's input record), the scheduler's output, and the plan it
fills while it schedules. No torch."""

from __future__ import annotations

from dataclasses import dataclass, field

from prefixgate.cache import StateOps
from prefixgate.engine.kv_connector import PageLoad
from prefixgate.engine.sequence import Sequence


@dataclass(frozen=True, slots=True)
class ScheduledChunk:
    """Compute positions ``[start_pos, start_pos + num_tokens)`` of ``seq`` this step.

    Also the runner's input record as it is (runner.RunnerChunk: ``token_ids``, ``start_pos``,
    ``block_table``, ``need_logits``, ``num_logits``): no conversion between the two.
    """

    seq: Sequence
    start_pos: int
    # the tokens at those positions (a copy: the sequence grows after this step), drafts last
    token_ids: list[int]
    need_logits: bool  # the chunk ends at the sequence's last known token: sample after it
    block_table: list[int]  # a copy made for this step (the manager's table keeps growing)
    # speculative decoding: draft tokens after the decode token, verified by this forward
    # (``num_tokens`` counts them; the sequence does not hold them until accepted)
    draft_ids: tuple[int, ...] = ()
    # a hybrid model's state work (cache.state_slots.StateOps: slot, restore, checkpoints)
    state: StateOps | None = None

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_logits(self) -> int:
        """Rows of logits after this chunk when it samples: one, plus one per draft verified."""
        return 1 + len(self.draft_ids)


@dataclass(frozen=True, slots=True)
class SchedulerOutput:
    chunks: tuple[ScheduledChunk, ...]
    copy_pairs: tuple[tuple[int, int], ...]  # copy-on-write, to run before the forward
    preempted: tuple[Sequence, ...]
    unschedulable: tuple[Sequence, ...]  # can never fit the pool as it is now: fail them
    page_loads: tuple[PageLoad, ...] = ()  # second-tier loads, written before the copies

    @property
    def num_tokens(self) -> int:
        return sum(c.num_tokens for c in self.chunks)

    @property
    def is_empty(self) -> bool:
        return not self.chunks




@dataclass(slots=True)
class StepPlan:
    """One step being planned: what is scheduled so far and what budget is left."""

    step_budget: int
    budget: float = 0.0
    chunks: list[ScheduledChunk] = field(default_factory=list)
    pairs: list[tuple[int, int]] = field(default_factory=list)
    preempted: list[Sequence] = field(default_factory=list)
    unschedulable: list[Sequence] = field(default_factory=list)  # can never fit: failed
    deferred: list[Sequence] = field(default_factory=list)  # dedup or tier waits: stay first
    loads: list[PageLoad] = field(default_factory=list)
    scheduled: set[int] = field(default_factory=set)
    has_prefill: bool = False  # a prefill chunk is in this step already
    # the short-prefill pass: pages the request it passed over first would take (it is owed
    # them), and what the last request that went back would have taken
    owed_pages: int = 0
    bounced_pages: int = 0
    num_decodes: int = 0

    def __post_init__(self) -> None:
        self.budget = self.step_budget
