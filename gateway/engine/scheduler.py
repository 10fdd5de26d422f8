"""Continuous-batching scheduler: chunked prefill, in-flight prefix dedup, admission on free
pages, preemption by recompute. Pure scheduling logic: no torch.

One step = ``schedule()`` → runner forward → ``commit()`` → the engine samples and calls
``append_token`` / ``finish``.
"""

from __future__ import annotations

import itertools
import math
import time
from collections import deque
from collections.abc import Callable, Hashable, Iterable
from collections.abc import Sequence as Seq
from dataclasses import dataclass, field
from typing import Any, Protocol

from prefixgate.cache import HashedBlock, KVCacheManager, PrefixMatch, StateOps
from prefixgate.gateway.engine.config import ADMISSION_ORDERS
from prefixgate.gateway.engine.drafter import NgramDrafter
from prefixgate.gateway.engine.sequence import SeqStatus, Sequence, TierProbe
from prefixgate.gateway.engine.step_pacing import StepPacer


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


class TierLoader(Protocol):
    """The second tier as the scheduler sees it (gateway/engine/kv_tier.KVTier)."""

    def may_contain(self, block: HashedBlock) -> bool | None: ...

    def request(self, key: Hashable, start_block: int, blocks: Seq[HashedBlock]) -> None: ...

    def poll(self, key: Hashable) -> Any: ...  # TierLoad | None while in flight

    def cancel(self, key: Hashable) -> None: ...


@dataclass(frozen=True, slots=True)
class PageLoad:
    """Write blocks ``offset ..`` of a tier load's ``payload`` into ``page_ids`` before the
    forward."""

    page_ids: tuple[int, ...]
    payload: Any
    offset: int


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


# Cache-aware admission ranks at most this many waiting requests a step, from the queue's head:
# a lookup per request per step stays cheap, and beyond it the queue is served in order
# (SGLang falls back to first come first served past 128 waiting requests).
ADMISSION_WINDOW = 64
# the short-prefill pass looks past at most this many waiting requests that do not fit whole
# (each look is a prefix lookup; a short turn further back waits for the queue to move)
MAX_PASSED_OVER = 16


@dataclass(slots=True)
class _StepPlan:
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


class Scheduler:
    """Decides, every step, which tokens of which sequences the model computes.

    Args:
        cache: the KV cache manager (prefix hits, pages, copy-on-write).
        max_num_batched_tokens: token budget of a step in which no stream decodes; prefills
            are chunked to fit it.
        decode_step_budget: the budget while any running stream decodes (bounds the
            inter-token latency); None = ``max_num_batched_tokens`` (one fixed budget).
        short_prefill_budget: a waiting request whose whole prefill costs at most this goes
            first and unsplit, even in a step whose budget is smaller (:meth:`_admit_short`);
            None = no widening (whole prefills that fit the step's budget still go first).
        max_num_seqs: running sequences at most.
        enable_dedup: hold back a request whose next uncached blocks another running
            sequence is computing right now; it is admitted once they are cached (in-flight
            prefix dedup: a burst sharing a cold prompt computes it once).
        context_scale: count a prefill chunk's attention in the budget: ``n`` tokens from
            position ``s`` cost ``n * (1 + (s + n / 2) / context_scale)`` (the model's
            ``attention_context_scale``: the context at which attention FLOPs equal the
            linear layers'). None = every token costs 1. A decode token always costs 1.
        protect_waiting: a waiting request's cached prefix is protected from eviction until
            it is admitted (soft: ``KVCacheManager.hold_prefix``).
        pacer: caps the prefill of a step with decodes by its modelled time (``slowdown`` x
            the decodes' own step; :mod:`step_pacing`), below the token budget; the engine
            feeds it every step (:meth:`observe_step`). None = the token budget alone.
        admission_order: "lpm" (longest cached prefix first, then least prefill compute,
            with ``max_admission_wait_s`` as the age bound: :meth:`_order_waiting`), "srpt"
            (least prefill compute left first, same age bound) or "fcfs" (arrival order).
        clock: seconds, monotonic (the age bound's clock).

    Two rules keep time-to-first-token low without giving up throughput:
      * the budget bounds a step's compute, not its token count (``context_scale``): a chunk
        deep into a long prompt, or a short suffix over a long cached prefix, is mostly
        attention, and a step packed with them by token count alone runs several times longer
        than one of fresh tokens, stalling every running decode and every request behind it;
      * a new prompt that would fit a step on its own is not split to fill a step's leftover
        budget when that step already carries a prefill: the split would cost it a second
        step for its first token; it goes first in the next step instead.
    """

    def __init__(
        self,
        cache: KVCacheManager,
        *,
        max_num_batched_tokens: int = 2048,
        max_num_seqs: int = 64,
        enable_dedup: bool = True,
        context_scale: int | None = None,
        tier: TierLoader | None = None,
        drafter: NgramDrafter | None = None,
        max_spec_rows: int = 8,
        decode_step_budget: int | None = None,
        short_prefill_budget: int | None = None,
        protect_waiting: bool = True,
        admission_order: str = "lpm",
        max_admission_wait_s: float = 90.0,
        pacer: StepPacer | None = None,
        clock: Callable[[], float] = time.monotonic,
    ):
        if max_num_batched_tokens < 1 or max_num_seqs < 1:
            raise ValueError("max_num_batched_tokens and max_num_seqs must be >= 1")
        if decode_step_budget is not None and decode_step_budget < 1:
            raise ValueError("decode_step_budget must be >= 1")
        if admission_order not in ADMISSION_ORDERS:
            raise ValueError(f"admission_order must be one of {ADMISSION_ORDERS}, got {admission_order!r}")
        self.cache = cache
        self.max_num_batched_tokens = max_num_batched_tokens
        self.decode_step_budget = min(decode_step_budget or max_num_batched_tokens, max_num_batched_tokens)
        self.short_prefill_budget = short_prefill_budget or 0
        self.protect_waiting = protect_waiting
        self.admission_order = admission_order
        self.max_admission_wait_s = max_admission_wait_s
        self.pacer = pacer
        self.clock = clock
        self.max_num_seqs = max_num_seqs
        self.enable_dedup = enable_dedup
        if context_scale is not None and context_scale < 1:
            raise ValueError("context_scale must be >= 1")
        self.context_scale = context_scale
        self.tier = tier
        self.drafter = drafter
        # drafts only while a step's decode rows (decodes + drafts) stay within this: below it
        # a CPU decode step is bound by streaming the weights and extra rows are nearly free;
        # above it the FMAs bind and a draft costs more than its expected accepted tokens
        self.max_spec_rows = max_spec_rows
        self.num_tier_waits = 0  # admissions deferred while their tier load ran
        # pages of tier loads in flight or held for admission, per sequence: at most a pool's
        # worth (a held load is host memory the size of its pages)
        self._tier_load_pages: dict[int, int] = {}
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []  # in admission order: preemption takes from the end
        self._admission = itertools.count()
        self.num_preemptions = 0
        self.num_dedup_waits = 0  # admissions deferred because the prefix was in flight

    # ------------------------------------------------------------------ queue management

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    @property
    def num_running(self) -> int:
        return len(self.running)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def add(self, seq: Sequence) -> None:
        seq.status = SeqStatus.WAITING
        seq.arrival_time = self.clock()
        self._hold(seq)
        self.waiting.append(seq)

    def remove_request(self, request_id: str) -> list[Sequence]:
        """Abort: drop every sequence of the request, releasing its pages now."""
        removed = [s for s in self.waiting if s.request_id == request_id]
        if removed:
            self.waiting = deque(s for s in self.waiting if s.request_id != request_id)
            for seq in removed:
                self.cache.release_hold(seq.seq_id)
        for seq in [s for s in self.running if s.request_id == request_id]:
            self._release(seq)
            removed.append(seq)
        for seq in removed:
            seq.status = SeqStatus.FINISHED
            self._drop_tier_load(seq)
        return removed

    def finish(self, seq: Sequence) -> None:
        """A running sequence is done: free its pages (tail first)."""
        self._release(seq)
        seq.status = SeqStatus.FINISHED

    def fork(self, parent: Sequence, child: Sequence) -> None:
        """``child`` shares ``parent``'s pages (n > 1); writes copy on demand."""
        self.cache.fork(parent.seq_id, child)
        child.num_cached_tokens = parent.num_cached_tokens
        child.status = SeqStatus.RUNNING
        child.admitted_order = next(self._admission)
        self.running.append(child)

    def append_token(self, seq: Sequence, token_id: int) -> None:
        seq.token_ids.append(token_id)  # its block hash comes when the cache needs it

    # ------------------------------------------------------------------ one step

    def step_budget(self) -> int:
        """The coming step's budget: ``decode_step_budget`` while any running stream decodes
        (a decode waits for the whole step: this bounds its inter-token latency; at least the
        decodes plus a page), else ``max_num_batched_tokens`` (nothing decodes: a prefill
        backlog runs in big chunks)."""
        decodes = sum(1 for s in self.running if s.num_uncomputed == 1)
        if decodes:
            # NOTE: at least a page of prefill a step, however many decode: a long prompt
            # admitted among max_num_seqs streams must not crawl one token a step
            budget = max(self.decode_step_budget, min(decodes + self.cache.page_size, self.max_num_batched_tokens))
            paced = self.pacer.prefill_units(decodes) if self.pacer is not None else None
            if paced is not None:
                # the step-time bound wins, below a page too: the oldest prefill still moves a
                # token a step (_schedule_running)
                budget = min(budget, decodes + int(paced))
            return budget
        return self.max_num_batched_tokens

    def observe_step(self, output: SchedulerOutput, seconds: float) -> None:
        """Feed an executed step's time to the pacer: its decode rows and the cost units of
        its prefill chunks (as :meth:`schedule` counted them)."""
        if self.pacer is None or output.is_empty:
            return
        decode_rows, units = 0, 0.0
        for c in output.chunks:
            prompt_left = c.seq.num_prompt_tokens - c.start_pos
            if prompt_left > 0:
                units += self._cost(c.start_pos, min(c.num_tokens, prompt_left))
            else:
                decode_rows += c.num_tokens
        self.pacer.observe(decode_rows, units, seconds)

    def schedule(self) -> SchedulerOutput:
        """Plan one step: every running decode, short prefills whole (:meth:`_admit_short`),
        the running prefills' next chunks, then admissions while free pages (above the
        watermark) and the budget allow."""
        plan = _StepPlan(self.step_budget())
        self._schedule_running(plan)  # its short-prefill pass ordered the waiting queue
        if not plan.preempted:
            self._admit(plan)
        self.waiting.extendleft(reversed(plan.deferred))  # dedup and tier waits stay first
        for seq in plan.unschedulable:
            seq.status = SeqStatus.FINISHED
        return SchedulerOutput(tuple(plan.chunks), tuple(plan.pairs), tuple(plan.preempted),
                               tuple(plan.unschedulable), tuple(plan.loads))

    def _schedule_running(self, plan: _StepPlan) -> None:
        """Running sequences, oldest first: every decode (1 token) first, then (after the
        short-prefill admissions) unfinished prefill chunks in what is left of the budget.

        NOTE: decodes are never skipped for budget: n > 1 forks can put more sequences in
        `running` than the budget has tokens, and a skipped decode would wait until older ones
        finish."""
        spec_rows = 0
        if self.drafter is not None:
            spec_rows = self.max_spec_rows - sum(1 for s in self.running if s.num_uncomputed == 1)
        oldest_prefill = next((s for s in self.running if s.num_uncomputed > 1), None)
        for decodes in (True, False):
            if not decodes and not plan.preempted:
                self._admit_short(plan)
            for seq in list(self.running):
                if (seq.status is not SeqStatus.RUNNING or (seq.num_uncomputed == 1) != decodes
                        or seq.seq_id in plan.scheduled):
                    continue
                drafts: list[int] = []
                if decodes:
                    n = 1
                    if self.drafter is not None and seq.draft is not None and spec_rows > 0:
                        spare = plan.budget - (len(self.running) - plan.num_decodes)
                        drafts = self._draft(seq, min(spec_rows, spare))
                else:  # NOTE: beside decodes the oldest moves a token at least, however deep
                    n = self._fit(seq.num_computed, seq.num_uncomputed, plan.budget, not plan.has_prefill
                                  or (seq is oldest_prefill and plan.num_decodes > 0))
                if n <= 0 or not self._make_room(plan, seq, n):
                    continue
                if drafts and self.cache.pages_needed(seq.seq_id, n, len(drafts)) > self.cache.num_free_pages:
                    drafts = []  # a draft never takes a page someone needs
                spec_rows -= len(drafts)
                plan.pairs += self.cache.prepare_write(seq.seq_id, n, len(drafts))
                plan.chunks.append(self._chunk(seq, n, drafts))
                plan.scheduled.add(seq.seq_id)
                plan.budget -= 1 + len(drafts) if decodes else self._cost(seq.num_computed, n)
                plan.num_decodes += decodes
                plan.has_prefill = plan.has_prefill or not decodes

    def _make_room(self, plan: _StepPlan, seq: Sequence, n: int) -> bool:
        """Preempt until ``seq``'s next ``n`` positions have pages; False if ``seq`` itself went."""
        while self.cache.pages_needed(seq.seq_id, n) > self.cache.num_free_pages:
            # the latest admitted that is not in this step yet (at worst seq itself)
            victim = next(v for v in reversed(self.running) if v.seq_id not in plan.scheduled)
            self._preempt(victim)
            plan.preempted.append(victim)
            if victim is seq:
                return False
        return True

    def _order_waiting(self) -> None:
        """Cache-aware admission (``admission_order="lpm"``, SGLang's longest prefix match):
        among the first ADMISSION_WINDOW waiting requests, the longest cached prefix goes first
        (its pages are used before they can be evicted, and it costs the least compute); equal
        prefixes (cold prompts above all) go least prefill compute first.

        NOTE: nothing starves: a preempted request, and one waiting ``max_admission_wait_s``
        or longer, go before every other, in arrival order. The tie-break is shortest job
        first: among cold prompts it minimises the sum of their waits, where arrival order
        made a short prompt (often a returning turn whose history was evicted) wait behind a
        backlog of long ones.
        """
        if self.admission_order == "fcfs" or len(self.waiting) < 2:
            return
        now = self.clock()
        window = [self.waiting.popleft() for _ in range(min(len(self.waiting), ADMISSION_WINDOW))]

        def rank(item: tuple[int, Sequence]) -> tuple[float, ...]:
            index, seq = item
            if seq.admitted_order >= 0 or now - seq.arrival_time >= self.max_admission_wait_s:
                return (0, 0, 0, index)
            seq.cached_blocks = self.cache.count_cached_blocks(self.cache.block_hashes(seq), seq.cached_blocks)
            cached = min(seq.cached_blocks * self.cache.page_size, len(seq.token_ids) - 1)
            cost = self._cost(cached, len(seq.token_ids) - cached)
            if self.admission_order == "srpt":
                return (1, cost, 0, index)
            return (1, -seq.cached_blocks, cost, index)

        ordered = [seq for _, seq in sorted(enumerate(window), key=rank)]
        self.waiting.extendleft(reversed(ordered))

    def _admit_short(self, plan: _StepPlan) -> None:
        """Before the running prefills' next chunks: admit waiting requests whose whole prefill
        fits what the step has left, in queue order, passing over up to MAX_PASSED_OVER that
        do not (they keep their place; under ``admission_order="fcfs"`` the first that does
        not stops it). The first admitted may widen the step to ``short_prefill_budget``;
        the rest fit the step's own budget (several short turns packed into one widened step
        would each wait for all of them). A page of budget stays for the prefill work behind
        them.

        NOTE: a returning turn's short suffix would otherwise wait behind every long prompt
        ahead of it (an aged one at the head of the queue above all) and, split to fit a
        small decode budget, pay several steps for its first token; a long prompt is chunked
        at the decode budget, so the running streams' inter-token latency stays bounded
        except for steps that carry one short prefill whole. The page kept back means a
        stream of short turns never starves a running long prompt (nor, through the age
        bound, a waiting one).
        """
        if not self.waiting:
            return
        self._order_waiting()
        reserve = self._reserve(plan)
        widen = max(0, self.short_prefill_budget - plan.step_budget)
        plan.budget -= reserve
        passed: list[Sequence] = []
        for _ in range(min(len(self.waiting), ADMISSION_WINDOW)):
            # NOTE: the first request passed over heads the queue for _admit: it keeps its
            # running slot and its pages, or a stream of short turns would take them every step
            # and starve it (aged or preempted as much as any)
            if plan.budget + widen <= 0 or len(self.running) + bool(passed) >= self.max_num_seqs:
                break
            seq = self.waiting.popleft()
            admitted = len(plan.chunks)
            plan.budget += widen
            if not self._try_admit(plan, seq, whole_only=True):
                if self.admission_order == "fcfs" or len(passed) == MAX_PASSED_OVER:
                    plan.budget -= widen  # arrival order: nothing passes it
                    break
                if not passed:
                    plan.owed_pages = plan.bounced_pages
                passed.append(self.waiting.popleft())  # _try_admit put it back at the head
            plan.budget -= widen
            if len(plan.chunks) > admitted:
                widen = 0  # this step's one widening is used
        self.waiting.extendleft(reversed(passed))
        plan.owed_pages = 0
        plan.budget = max(plan.budget, 0) + reserve

    def _reserve(self, plan: _StepPlan) -> int:
        """Budget the short-prefill pass leaves to the prefill work behind it: a page while
        streams decode."""
        return self.cache.page_size if plan.num_decodes else 0

    def _admit(self, plan: _StepPlan) -> None:
        """Admit waiting sequences in queue order while the step has budget and room."""
        while self.waiting and plan.budget > 0 and len(self.running) < self.max_num_seqs:
            if not self._try_admit(plan, self.waiting.popleft()):
                break

    def _try_admit(self, plan: _StepPlan, seq: Sequence, whole_only: bool = False) -> bool:
        """Admit ``seq`` into this step, defer it, or fail it; False = it goes back to the
        head of the queue and admission stops (FIFO: nothing behind it goes first)."""
        plan.bounced_pages = 0
        blocks = self.cache.block_hashes(seq)
        match = self.cache.find_prefix(seq.token_ids, seq.extra_keys, blocks=blocks)
        if self.enable_dedup and match.num_pending_tokens > 0:
            # NOTE: another running sequence is computing our next blocks right now;
            # admitting us would compute them twice. Wait a step, hit them after.
            plan.deferred.append(seq)
            self.num_dedup_waits += 1
            return True
        tier_blocks = 0
        if self.tier is not None:
            tier_blocks, loading = self._tier_continuation(seq, blocks, match)
            if loading:  # NOTE: the request waits for its load; the step does not
                plan.deferred.append(seq)
                self.num_tier_waits += 1
                return True
        start = match.num_cached_tokens
        if tier_blocks:
            start = min((len(match.page_ids) + tier_blocks) * self.cache.page_size, len(seq.token_ids) - 1)
        # the same count with or without a held load: installed pages come out of the free
        # ones and stay free (refcount 0) until this allocation takes them
        needed = self.cache.pages_needed_for_prompt(len(seq.token_ids), match)
        if self._waits_for_budget(plan, start, len(seq.token_ids) - start, whole_only):
            self.waiting.appendleft(seq)  # a held tier load stays held
            plan.bounced_pages = 0 if self._never_fits(needed, match) else needed
            return False
        if plan.owed_pages and not self.cache.can_allocate(needed + plan.owed_pages):
            self.waiting.appendleft(seq)  # the pages are owed to the request it passed
            return False
        if not self.cache.can_allocate(needed):
            # NOTE: more pages than the whole pool holds can never fit: fail it now, or it
            # would stop admission at the head of the queue until the engine drains
            never = self._never_fits(needed, match)
            idle = not self.running and not plan.chunks
            if not idle and not never:
                self.waiting.appendleft(seq)
                plan.bounced_pages = needed
                return False
            if never or needed > self.cache.num_free_pages:
                self._drop_tier_load(seq)
                self.cache.release_hold(seq.seq_id)
                plan.unschedulable.append(seq)  # even an empty engine cannot hold it
                return True
        if tier_blocks:
            match = self._install_tier_load(seq, blocks, match, plan.loads)
            if self.cache.pages_needed_for_prompt(len(seq.token_ids), match) > self.cache.num_free_pages:
                # NOTE: the pool held blocks past the load (protected for us): the hit grew to
                # the whole prompt, whose last block is copied on write, one page more than
                # counted. The load is installed (and written this step); the next look counts it.
                self.waiting.appendleft(seq)
                return False
        if self._waits_for_state_slot(seq, blocks, match):
            return False
        self._start(plan, seq)
        return True

    def _waits_for_state_slot(self, seq: Sequence, blocks: list[HashedBlock], match: PrefixMatch) -> bool:
        """A hybrid model's request waits (at the queue head) while no state slot is free.

        NOTE: every slot is a live sequence's or a checkpoint another request is about to
        restore: the pages would fit, the state would not; one frees when a sequence ends."""
        if self.cache.can_start_sequence(blocks, match, 1 + seq.num_choices_to_fork):
            return False
        self.waiting.appendleft(seq)
        return True

    def _waits_for_budget(self, plan: _StepPlan, start: int, remaining: int, whole_only: bool) -> bool:
        """Whether a request with ``remaining`` tokens from ``start`` waits for a later step:
        nothing fits, or it would fit the next step whole (split here, its first token would
        wait a second step anyway), or ``whole_only`` and it does not fit whole."""
        n = self._fit(start, remaining, plan.budget, not plan.has_prefill)
        # what the next step's short-prefill pass would leave it (widened, less the reserve)
        # NOTE: counted without the reserve, a request costing just under the widened step
        # bounced here "to go whole next step", and never fit the short pass either: at the
        # queue head it stopped admission for as long as any prefill ran beside it
        own_step = max(plan.step_budget, self.short_prefill_budget) - plan.num_decodes - self._reserve(plan)
        return n <= 0 or (n < remaining and (whole_only or plan.has_prefill and self._cost(start, remaining) <= own_step))

    def _never_fits(self, needed: int, match: PrefixMatch) -> bool:
        """Whether a prompt needing ``needed`` free pages over ``match`` holds more pages than
        the whole pool (``needed`` counts the free hit pages it takes: they are its own)."""
        return needed - match.num_free_hit_pages + len(match.page_ids) > self.cache.num_pages

    def _start(self, plan: _StepPlan, seq: Sequence) -> None:
        """Allocate ``seq`` (sharing its cached prefix) and schedule its first chunk."""
        self.cache.allocate(seq, count_query=seq.num_cached_tokens is None)  # sets num_computed
        self.cache.release_hold(seq.seq_id)  # its hit is referenced now
        if seq.num_cached_tokens is None:
            seq.num_cached_tokens = seq.num_computed
        seq.status = SeqStatus.RUNNING
        seq.admitted_order = next(self._admission)
        self.running.append(seq)
        n = self._fit(seq.num_computed, seq.num_uncomputed, plan.budget, not plan.has_prefill)
        plan.pairs += self.cache.prepare_write(seq.seq_id, n)
        plan.chunks.append(self._chunk(seq, n))
        plan.scheduled.add(seq.seq_id)
        plan.budget -= self._cost(seq.num_computed, n)
        plan.has_prefill = True

    def commit(self, output: SchedulerOutput) -> None:
        """After the forward pass: the chunks' K/V is in the pages; full blocks become cached."""
        for chunk in output.chunks:
            seq = chunk.seq
            if seq.status is not SeqStatus.RUNNING:
                continue  # aborted while the forward ran
            # drafts become computed only once accepted (accept_drafts)
            self.cache.commit_computed(seq.seq_id, chunk.num_tokens - len(chunk.draft_ids))

    def accept_drafts(self, seq: Sequence, num_accepted: int) -> None:
        """``num_accepted`` draft tokens were appended to ``seq`` (with one token after them):
        their K/V, written by the verify forward, is the sequence's now.

        NOTE: the rejected drafts' K/V stays in pages past ``num_computed``, where the next
        tokens overwrite it; no block holding one is ever registered (only computed full
        blocks are), so rejected drafts leave no trace in the cache."""
        if num_accepted and seq.status is SeqStatus.RUNNING:
            self.cache.commit_computed(seq.seq_id, num_accepted)

    # ------------------------------------------------------------------ internals

    def _tier_continuation(self, seq: Sequence, blocks: list[HashedBlock],
                           match: PrefixMatch) -> tuple[int, bool]:
        """How far the second tier continues ``seq``'s pool hit ``match``. Returns (blocks a
        finished load holds right after the hit, whether ``seq`` must wait for a load).

        A finished load is held on the sequence and installed only in the step that admits it
        (:meth:`_install_tier_load`): installed early, its pages would sit free in the pool
        while the request waits for room, and the traffic it waits behind would evict them
        again. The tier is looked up again whenever the pool's hit has changed since the last
        look: pages evicted while the request waited went to the tier too.
        """
        assert self.tier is not None
        first = len(match.page_ids)
        if seq.tier_probe is TierProbe.LOADING:
            load = self.tier.poll(seq.seq_id)
            if load is None:
                return 0, True
            seq.tier_probe, seq.tier_load = TierProbe.HELD, load
        if seq.tier_probe is TierProbe.HELD:
            load = seq.tier_load
            skip = first - load.start_block
            if load.blocks and 0 <= skip < len(load.blocks):
                return len(load.blocks) - skip, False
            # empty (a miss, late or doubtful), overtaken by the pool, or the pool lost blocks
            # before the load's start while it waited (those went to the tier: look again)
            lost = bool(load.blocks) and skip < 0
            self._drop_tier_load(seq)
            seq.tier_probe, seq.tier_probe_blocks = TierProbe.DONE, -1 if lost else first
        if seq.tier_probe is TierProbe.DONE and seq.tier_probe_blocks == first:
            return 0, False
        # a full hit stops one token short anyway: a last block alone is not worth a load
        wanted = blocks[first : (len(seq.token_ids) - 1) // self.cache.page_size]
        if any(self.cache.evicted_since_taken(b.block_hash) for b in wanted):
            # evicted by this very schedule(): spilled once it returns, looked up next step
            seq.tier_probe, seq.tier_probe_blocks = TierProbe.DONE, -1
            return 0, True
        seq.tier_probe, seq.tier_probe_blocks = TierProbe.DONE, first
        if not wanted or self.tier.may_contain(wanted[0]) is False:
            return 0, False
        if sum(self._tier_load_pages.values()) + len(wanted) > self.cache.num_pages:
            return 0, False  # loads already hold a pool's worth of pages: recompute this one
        self.tier.request(seq.seq_id, first, wanted)
        self._tier_load_pages[seq.seq_id] = len(wanted)
        seq.tier_probe = TierProbe.LOADING
        return 0, True

    def _install_tier_load(self, seq: Sequence, blocks: list[HashedBlock], match: PrefixMatch,
                           loads: list[PageLoad]) -> PrefixMatch:
        """Give ``seq``'s held load pages right before it is allocated; returns the new hit."""
        load = seq.tier_load
        skip = len(match.page_ids) - load.start_block
        self._drop_tier_load(seq)
        page_ids = self.cache.install_blocks(load.blocks[skip:], len(load.blocks) - skip,
                                             keep=match.page_ids)
        if not page_ids:
            return match
        loads.append(PageLoad(tuple(page_ids), load.payload, skip))
        return self.cache.find_prefix(seq.token_ids, seq.extra_keys, blocks=blocks)

    def _drop_tier_load(self, seq: Sequence) -> None:
        """Forget ``seq``'s tier load: cancel it in flight, release a held one."""
        if seq.tier_probe is TierProbe.LOADING and self.tier is not None:
            self.tier.cancel(seq.seq_id)
        if seq.tier_probe in (TierProbe.LOADING, TierProbe.HELD):
            seq.tier_probe = TierProbe.DONE
        seq.tier_load = None
        self._tier_load_pages.pop(seq.seq_id, None)

    def _cost(self, start: int, n: int) -> float:
        """Budget units of computing ``n`` prompt tokens from position ``start``."""
        if self.context_scale is None:
            return n
        return n * (1 + (start + n / 2) / self.context_scale)

    def _fit(self, start: int, remaining: int, budget: float, force_one: bool) -> int:
        """How many of the ``remaining`` tokens from ``start`` fit ``budget``.

        ``force_one``: at least one token even when it costs more than what is left, so the
        first prefill of a step always progresses (deep into a long context one token can
        cost more than a whole budget). Later chunks never take a crumb of leftover budget: a
        long prompt admitted for one token a step would hold its pages and a running slot.
        """
        if remaining <= 0 or (budget <= 0 and not force_one):
            return 0
        if self.context_scale is None:
            n = int(budget)
        else:
            # the largest n with n * (C + start + n / 2) <= budget * C
            c = self.context_scale + start
            n = int(-c + math.sqrt(c * c + 2 * max(budget, 0) * self.context_scale))
            while n > 0 and self._cost(start, n) > budget:  # float rounding
                n -= 1
        return min(remaining, max(n, 1 if force_one else 0))

    def _chunk(self, seq: Sequence, n: int, drafts: list[int] | None = None) -> ScheduledChunk:
        start = seq.num_computed
        token_ids = seq.token_ids[start : start + n]
        if drafts:
            token_ids += drafts
        return ScheduledChunk(
            seq=seq,
            start_pos=start,
            token_ids=token_ids,
            need_logits=start + n == len(seq.token_ids),
            block_table=self.cache.block_table(seq.seq_id),
            draft_ids=tuple(drafts or ()),
            state=self.cache.state_ops(seq.seq_id),
        )

    def _draft(self, seq: Sequence, spare_budget: float) -> list[int]:
        """Draft tokens for ``seq``'s decode: at most what the step's budget spares after every
        running decode, and what the request may still output after this step's token."""
        assert self.drafter is not None
        room = min(int(spare_budget), seq.sampling.max_tokens - seq.num_output_tokens - 1)
        if room < 1:
            return []
        return self.drafter.propose(seq.token_ids, seq.draft, room)

    def _preempt(self, seq: Sequence) -> None:
        """Recompute-style preemption: free the pages, requeue at the front.

        Its cached prefix usually survives (freed pages stay hittable until reused), so the
        recompute is mostly hits.
        """
        self._release(seq)
        seq.status = SeqStatus.WAITING
        seq.num_computed = 0
        self._drop_tier_load(seq)
        seq.tier_probe = TierProbe.NONE  # its evicted pages may be in the tier by the time it returns
        self._hold(seq)  # the pages it just freed are its own prefix when it returns
        self.waiting.appendleft(seq)
        self.num_preemptions += 1

    def _hold(self, seq: Sequence) -> None:
        """Protect ``seq``'s cached prefix while it waits (released by :meth:`_start`)."""
        if self.protect_waiting:
            self.cache.hold_prefix(seq.seq_id, self.cache.block_hashes(seq))

    def _release(self, seq: Sequence) -> None:
        if seq in self.running:
            self.running.remove(seq)
        if seq.seq_id in self.cache:
            self.cache.free(seq.seq_id)

    def iter_live(self) -> Iterable[Sequence]:
        yield from self.running
        yield from self.waiting
