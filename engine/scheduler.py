"""Continuous-batching scheduler: chunked prefill, in-flight prefix dedup, admission on free
pages, preemption by recompute. Pure scheduling logic: no torch.

One step = ``schedule()`` → runner forward → ``commit()`` → the engine samples and calls
``append_token`` / ``finish``. How waiting requests are admitted is its half in admission.py;
the step's records are in step_plan.py; the budgets and chunk costs in step_budget.py.
"""

from __future__ import annotations

import itertools
import time
from collections import deque
from collections.abc import Callable, Iterable

from prefixgate.cache import KVCacheManager
from prefixgate.engine.admission import Admission
from prefixgate.engine.config import ADMISSION_ORDERS, EngineConfig
from prefixgate.engine.drafter import NgramDrafter
from prefixgate.engine.kv_connector import KVConnector, PageLoad
from prefixgate.engine.kv_control import KVControl
from prefixgate.engine.sequence import SeqStatus, Sequence
from prefixgate.engine.step_budget import StepBudgets, StepCost
from prefixgate.engine.step_pacing import StepPacer
from prefixgate.engine.step_plan import ScheduledChunk, SchedulerOutput, StepPlan

__all__ = ["PageLoad", "ScheduledChunk", "Scheduler", "SchedulerOutput", "StepBudgets"]


class Scheduler(Admission):
    """Decides, every step, which tokens of which sequences the model computes.

    Args:
        cache: the KV cache manager (prefix hits, pages, copy-on-write).
        config: the settings it reads: ``max_num_seqs`` (running sequences at most),
            ``enable_prefix_caching`` (also in-flight prefix dedup: hold back a request whose
            next uncached blocks another running sequence is computing right now; a burst
            sharing a cold prompt computes it once), ``protect_waiting`` (a waiting request's
            cached prefix is protected from eviction until it is admitted: soft,
            ``KVCacheManager.hold_prefix``), ``admission_order`` ("lpm": longest cached prefix
            first, then least prefill compute, with ``max_admission_wait_s`` as the age bound;
            "srpt": least prefill compute first, same age bound; "fcfs": arrival order) and
            ``speculative_max_rows``.
        budgets: the step's token budgets and chunk cost (step_budget.step_budgets derives
            them from the config and the device).
        connector: the second tier (kv_connector.KVConnector); None = none.
        drafter: speculative decoding's drafter; None = off.
        pacer: caps the prefill of a step with decodes by its modelled time (``slowdown`` x
            the decodes' own step; :mod:`step_pacing`), below the token budget; the engine
            feeds it every step (:meth:`observe_step`). None = the token budget alone.
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

    def __init__(self, cache: KVCacheManager, config: EngineConfig | None = None, *,
                 budgets: StepBudgets | None = None, connector: KVConnector | None = None,
                 drafter: NgramDrafter | None = None, pacer: StepPacer | None = None,
                 clock: Callable[[], float] = time.monotonic):
        config = config or EngineConfig()
        budgets = budgets or StepBudgets()
        if config.admission_order not in ADMISSION_ORDERS:
            raise ValueError(f"admission_order must be one of {ADMISSION_ORDERS}, "
                             f"got {config.admission_order!r}")
        self.cache = cache
        self.kv = KVControl(cache)  # the cache's door for the engine and the gateway
        self.max_num_batched_tokens = budgets.max_num_batched_tokens
        self.decode_step_budget = min(budgets.decode_step_budget or self.max_num_batched_tokens,
                                      self.max_num_batched_tokens)
        self.short_prefill_budget = budgets.short_prefill_budget or 0
        self.context_scale = budgets.context_scale
        self.costs = StepCost(budgets.context_scale)
        self.max_num_seqs = config.max_num_seqs
        self.enable_dedup = config.enable_prefix_caching
        self.protect_waiting = config.protect_waiting
        self.admission_order = config.admission_order
        self.max_admission_wait_s = config.max_admission_wait_s
        # drafts only while a step's decode rows (decodes + drafts) stay within this: below it
        # a CPU decode step is bound by streaming the weights and extra rows are nearly free;
        # above it the FMAs bind and a draft costs more than its expected accepted tokens
        self.max_spec_rows = config.speculative_max_rows
        self.connector = connector  # the second tier (pages not resident), None = none
        self.drafter = drafter
        self.pacer = pacer
        self.clock = clock
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
            self._forget_tier(seq)
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

    def pin_prompt(self, seq: Sequence) -> None:
        """Pin ``seq``'s computed prompt blocks (a pin request, as it finishes)."""
        self.cache.pin(seq.token_ids[: seq.num_prompt_tokens], seq.extra_keys)

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
                units += self.costs.cost(c.start_pos, min(c.num_tokens, prompt_left))
            else:
                decode_rows += c.num_tokens
        self.pacer.observe(decode_rows, units, seconds)

    def schedule(self) -> SchedulerOutput:
        """Plan one step: every running decode, short prefills whole (:meth:`_admit_short`),
        the running prefills' next chunks, then admissions while free pages (above the
        watermark) and the budget allow."""
        plan = StepPlan(self.step_budget())
        self._schedule_running(plan)  # its short-prefill pass ordered the waiting queue
        if not plan.preempted:
            self._admit(plan)
        self.waiting.extendleft(reversed(plan.deferred))  # dedup and tier waits stay first
        for seq in plan.unschedulable:
            seq.status = SeqStatus.FINISHED
        return SchedulerOutput(tuple(plan.chunks), tuple(plan.pairs), tuple(plan.preempted),
                               tuple(plan.unschedulable), tuple(plan.loads))

    def _schedule_running(self, plan: StepPlan) -> None:
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
                    n = self.costs.fit(seq.num_computed, seq.num_uncomputed, plan.budget, not plan.has_prefill
                                  or (seq is oldest_prefill and plan.num_decodes > 0))
                if n <= 0 or not self._make_room(plan, seq, n):
                    continue
                if drafts and self.cache.pages_needed(seq.seq_id, n, len(drafts)) > self.cache.num_free_pages:
                    drafts = []  # a draft never takes a page someone needs
                spec_rows -= len(drafts)
                plan.pairs += self.cache.prepare_write(seq.seq_id, n, len(drafts))
                plan.chunks.append(self._chunk(seq, n, drafts))
                plan.scheduled.add(seq.seq_id)
                plan.budget -= 1 + len(drafts) if decodes else self.costs.cost(seq.num_computed, n)
                plan.num_decodes += decodes
                plan.has_prefill = plan.has_prefill or not decodes

    def _make_room(self, plan: StepPlan, seq: Sequence, n: int) -> bool:
        """Preempt until ``seq``'s next ``n`` positions have pages; False if ``seq`` itself went."""
        while self.cache.pages_needed(seq.seq_id, n) > self.cache.num_free_pages:
            # the latest admitted that is not in this step yet (at worst seq itself)
            victim = next(v for v in reversed(self.running) if v.seq_id not in plan.scheduled)
            self._preempt(victim)
            plan.preempted.append(victim)
            if victim is seq:
                return False
        return True

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

    def _forget_tier(self, seq: Sequence) -> None:
        if self.connector is not None:
            self.connector.forget(seq)

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
        self._forget_tier(seq)  # its evicted pages may be in the tier by the time it returns
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
