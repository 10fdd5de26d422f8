"""How waiting requests enter a step: cache-aware ordering, short prefills first and whole,
admission on free pages, the second tier's and the state slots' waits. The scheduler's half
that looks at the waiting queue (a mixin of :class:`scheduler.Scheduler`, which owns the state
it reads). No torch."""

from __future__ import annotations

import itertools
from collections import deque
from collections.abc import Callable

from prefixgate.cache import HashedBlock, KVCacheManager, PrefixMatch
from prefixgate.engine.kv_connector import KVConnector
from prefixgate.engine.sequence import SeqStatus, Sequence
from prefixgate.engine.step_budget import StepCost
from prefixgate.engine.step_plan import ScheduledChunk, StepPlan

# Cache-aware admission ranks at most this many waiting requests a step, from the queue's head:
# a lookup per request per step stays cheap, and beyond it the queue is served in order
# (SGLang falls back to first come first served past 128 waiting requests).
ADMISSION_WINDOW = 64
# the short-prefill pass looks past at most this many waiting requests that do not fit whole
# (each look is a prefix lookup; a short turn further back waits for the queue to move)
MAX_PASSED_OVER = 16


class Admission:
    """Admission (mixed into the Scheduler): the attributes below are the scheduler's."""

    cache: KVCacheManager
    connector: KVConnector | None
    costs: StepCost
    waiting: deque[Sequence]
    running: list[Sequence]
    max_num_seqs: int
    enable_dedup: bool
    admission_order: str
    max_admission_wait_s: float
    short_prefill_budget: int
    clock: Callable[[], float]
    num_dedup_waits: int
    _admission: itertools.count[int]
    _chunk: Callable[..., ScheduledChunk]
    _forget_tier: Callable[[Sequence], None]

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
            cost = self.costs.cost(cached, len(seq.token_ids) - cached)
            if self.admission_order == "srpt":
                return (1, cost, 0, index)
            return (1, -seq.cached_blocks, cost, index)

        ordered = [seq for _, seq in sorted(enumerate(window), key=rank)]
        self.waiting.extendleft(reversed(ordered))

    def _admit_short(self, plan: StepPlan) -> None:
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

    def _reserve(self, plan: StepPlan) -> int:
        """Budget the short-prefill pass leaves to the prefill work behind it: a page while
        streams decode."""
        return self.cache.page_size if plan.num_decodes else 0

    def _admit(self, plan: StepPlan) -> None:
        """Admit waiting sequences in queue order while the step has budget and room."""
        while self.waiting and plan.budget > 0 and len(self.running) < self.max_num_seqs:
            if not self._try_admit(plan, self.waiting.popleft()):
                break

    def _try_admit(self, plan: StepPlan, seq: Sequence, whole_only: bool = False) -> bool:
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
        tier_tokens = 0
        if self.connector is not None:
            tier_tokens, ready = self.connector.match(seq, blocks, match)
            if not ready:  # NOTE: the request waits for its load; the step does not
                plan.deferred.append(seq)
                return True
        start = match.num_cached_tokens
        if tier_tokens:
            start = min(len(match.page_ids) * self.cache.page_size + tier_tokens, len(seq.token_ids) - 1)
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
                self._forget_tier(seq)
                self.cache.release_hold(seq.seq_id)
                plan.unschedulable.append(seq)  # even an empty engine cannot hold it
                return True
        if tier_tokens:
            assert self.connector is not None
            match = self.connector.install(seq, blocks, match, plan.loads)
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

    def _waits_for_budget(self, plan: StepPlan, start: int, remaining: int, whole_only: bool) -> bool:
        """Whether a request with ``remaining`` tokens from ``start`` waits for a later step:
        nothing fits, or it would fit the next step whole (split here, its first token would
        wait a second step anyway), or ``whole_only`` and it does not fit whole."""
        n = self.costs.fit(start, remaining, plan.budget, not plan.has_prefill)
        # what the next step's short-prefill pass would leave it (widened, less the reserve)
        # NOTE: counted without the reserve, a request costing just under the widened step
        # bounced here "to go whole next step", and never fit the short pass either: at the
        # queue head it stopped admission for as long as any prefill ran beside it
        own_step = max(plan.step_budget, self.short_prefill_budget) - plan.num_decodes - self._reserve(plan)
        return n <= 0 or (n < remaining and (whole_only or plan.has_prefill and self.costs.cost(start, remaining) <= own_step))

    def _never_fits(self, needed: int, match: PrefixMatch) -> bool:
        """Whether a prompt needing ``needed`` free pages over ``match`` holds more pages than
        the whole pool (``needed`` counts the free hit pages it takes: they are its own)."""
        return needed - match.num_free_hit_pages + len(match.page_ids) > self.cache.num_pages

    def _start(self, plan: StepPlan, seq: Sequence) -> None:
        """Allocate ``seq`` (sharing its cached prefix) and schedule its first chunk."""
        self.cache.allocate(seq, count_query=seq.num_cached_tokens is None)  # sets num_computed
        self.cache.release_hold(seq.seq_id)  # its hit is referenced now
        self._forget_tier(seq)
        if seq.num_cached_tokens is None:
            seq.num_cached_tokens = seq.num_computed
        seq.status = SeqStatus.RUNNING
        seq.admitted_order = next(self._admission)
        self.running.append(seq)
        n = self.costs.fit(seq.num_computed, seq.num_uncomputed, plan.budget, not plan.has_prefill)
        plan.pairs += self.cache.prepare_write(seq.seq_id, n)
        plan.chunks.append(self._chunk(seq, n))
        plan.scheduled.add(seq.seq_id)
        plan.budget -= self.costs.cost(seq.num_computed, n)
        plan.has_prefill = True
