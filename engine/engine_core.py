"""The synchronous engine core: requests in, one step at a time, deltas out.

Single-threaded by design: the async front (async_engine.py) owns the only thread that calls
``step()``. A step is schedule (the scheduler decides; its connector moves second-tier pages)
-> execute (the runner computes, with fault isolation) -> update (step_sampling picks the
tokens, each row isolated; the output processor turns them into deltas). docs/engine.md.
"""

from __future__ import annotations

import logging
import time
from typing import Any, Protocol

import torch

from prefixgate.cache import make_extra_keys
from prefixgate.engine.api import (
    EngineError,
    GenerationRequest,
    InvalidRequestError,
)
from prefixgate.engine.config import EngineConfig
from prefixgate.engine.grammar import CompiledGrammar
from prefixgate.engine.grammar_service import GrammarService
from prefixgate.engine.isolation import execute_isolated, isolated_failure
from prefixgate.engine.kv_connector import TierLoader
from prefixgate.engine.output_processor import OutputProcessor
from prefixgate.engine.request_state import RequestState, Sink
from prefixgate.engine.scheduler import Scheduler, SchedulerOutput
from prefixgate.engine.sequence import Sequence
from prefixgate.engine.state_tier import StateTier
from prefixgate.engine.step_counters import StepCounters, counter
from prefixgate.engine.step_masks import StepMasks
from prefixgate.engine.step_sampling import StepForward, StepSampler
from prefixgate.engine.validation import check_queue, validate_request

logger = logging.getLogger("prefixgate.engine")

__all__ = ["LLMEngine", "RunnerLike", "Sink"]


class RunnerLike(Protocol):
    num_pages: int
    page_size: int
    max_model_len: int
    vocab_size: int

    def execute(self, chunks: list[Any], copy_pairs: list[tuple[int, int]] = ...) -> torch.Tensor: ...


class LLMEngine:
    """Continuous-batching engine over a paged KV cache.

    Args:
        runner: computes logits for scheduled chunks (engine.runner.ModelRunner).
        tokenizer: encode/decode + ``incremental_decoder()`` + ``eos_token_ids``.
        config: the engine's settings.
        scheduler: decides each step; its KV manager is the only owner of the cache.
        model_id: enters the block hash (a cache never serves another model's KV).
    """

    num_steps = counter("num_steps")
    prefill_tokens_computed = counter("prefill_tokens_computed")
    decode_tokens = counter("decode_tokens")
    constrained_tokens = counter("constrained_tokens")
    spec_tokens_accepted = counter("spec_tokens_accepted")
    seconds_per_token = counter("seconds_per_token")

    def __init__(self, runner: RunnerLike, tokenizer: Any, config: EngineConfig,
                 scheduler: Scheduler, *, model_id: str = ""):
        self.runner = runner
        self.tokenizer = tokenizer
        self.config = config
        self.scheduler = scheduler
        self.model_id = model_id
        self.page_size = runner.page_size
        self.max_model_len = min(config.max_model_len or runner.max_model_len, runner.max_model_len)
        self.kv = scheduler.kv  # the only way to the cache besides the scheduler's steps
        self.counters = StepCounters()
        self.grammars = GrammarService(tokenizer, runner.vocab_size, config)
        self.output = OutputProcessor(tokenizer, scheduler, self.counters, self.max_model_len)
        drafter = scheduler.drafter
        self.sampler = StepSampler(self.grammars.masker, self.output.fail, self._fork,
                                   drafter.record if drafter is not None else None)

    def attach_tier(self, tier: TierLoader) -> None:
        """Spill evicted pages to ``tier`` (kv_tier.KVTier) and load them back on a hit; a
        hybrid model's evicted state checkpoints go to host memory beside it."""
        runner: Any = self.runner
        state_tier = (StateTier(runner.states, runner.num_state_slots)
                      if self.kv.has_state_group else None)
        self.scheduler.connector = self.kv.connector(tier, state_tier)

    @property
    def tier(self) -> Any:
        """The second tier (None without one)."""
        connector = self.scheduler.connector
        return connector.tier if connector is not None else None

    @property
    def tier_tokens_loaded(self) -> int:
        connector = self.scheduler.connector
        return connector.tokens_loaded if connector is not None else 0

    # ------------------------------------------------------------------ stats

    def tier_stats(self) -> dict[str, Any] | None:
        """The second tier's counters plus the recompute it saved (None without a tier)."""
        connector = self.scheduler.connector
        return connector.stats(self.seconds_per_token) if connector is not None else None

    def tier_load_discount(self) -> float | None:
        """What a tier hit saves of a recompute, per token (KVConnector.load_discount)."""
        connector = self.scheduler.connector
        return connector.load_discount(self.seconds_per_token) if connector is not None else None

    def spec_stats(self) -> dict[str, int]:
        """Speculative decoding counters for EngineStats (zeros when it is off)."""
        drafter = self.scheduler.drafter
        return {
            "spec_drafts": drafter.num_drafts if drafter else 0,
            "spec_draft_tokens": drafter.num_proposed if drafter else 0,
            "spec_accepted_tokens": self.spec_tokens_accepted,
        }

    # ------------------------------------------------------------------ requests

    def extra_keys_for(self, tenant: str, cache_salt: str | None) -> bytes:
        return make_extra_keys(self.model_id, tenant, cache_salt)

    def validate(self, request: GenerationRequest) -> None:
        """Raise the error a request would hit, before it is queued (validation.py)."""
        validate_request(request, vocab_size=self.runner.vocab_size, max_model_len=self.max_model_len,
                         num_pages=self.kv.num_pages, page_size=self.page_size)

    def add_request(self, request: GenerationRequest, sink: Sink, *, pin_when_done: bool = False,
                    grammar: CompiledGrammar | None = None) -> None:
        """Validate and queue a request (a caller that drives the core itself: the async
        front validates at its edge and calls :meth:`enqueue`)."""
        self.validate(request)
        check_queue(self.scheduler.num_waiting, self.config.max_waiting)
        self.enqueue(request, sink, pin_when_done=pin_when_done, grammar=grammar)

    def enqueue(self, request: GenerationRequest, sink: Sink, *, pin_when_done: bool = False,
                grammar: CompiledGrammar | None = None) -> None:
        """Queue a validated request; deltas (or an EngineError) go to ``sink`` from the engine
        thread. ``grammar``: ``request.grammar`` compiled (here when None)."""
        if request.grammar is not None and grammar is None:
            grammar = self.grammars.compile(request.grammar, request.tenant)
        if request.request_id in self.output.requests:
            raise InvalidRequestError(f"duplicate request id {request.request_id}")
        state = RequestState(request, sink, self.extra_keys_for(request.tenant, request.cache_salt),
                             pin_when_done=pin_when_done,
                             grammar=grammar if request.grammar is not None else None)
        seq = self.output.new_sequence(state, 0, list(request.prompt_token_ids))
        seq.num_choices_to_fork = request.sampling.n - 1
        self.output.requests[request.request_id] = state
        self.scheduler.add(seq)

    def abort(self, request_id: str) -> bool:
        """Drop a request now (client gone); its pages are released. False if unknown."""
        if self.output.requests.pop(request_id, None) is None:
            return False
        self.scheduler.remove_request(request_id)
        return True

    def finish_early(self, request_id: str) -> bool:
        """End a request now as if it had stopped (finish "stop", then its usage), releasing
        its pages: the gateway ends a turn whose output went degenerate (a repeated tool call,
        gateway/server/tools/repeats.py). False if unknown (already finished or aborted)."""
        state = self.output.requests.get(request_id)
        if state is None or state.request.sampling.n != 1:  # n > 1: choices not forked yet
            return False
        # released as an abort releases them (waiting or running, tier loads dropped); the
        # finish below then only reports it (its scheduler.finish finds nothing left to free)
        self.scheduler.remove_request(request_id)
        for seq in list(state.seqs):
            if seq.finish_reason is None and request_id in self.output.requests:
                self.output.emit(seq, (), "", "stop", None)
        return True

    def has_work(self) -> bool:
        return self.scheduler.has_work()

    @property
    def num_requests(self) -> int:
        return len(self.output.requests)

    # ------------------------------------------------------------------ one step

    def step(self) -> SchedulerOutput:
        """One step: schedule -> execute -> update (docs/engine.md)."""
        began = time.perf_counter()
        out = self._schedule()
        if out.is_empty:
            return out
        forward = self._execute(out)
        self._update(out, forward)
        # the whole step, as a decoding stream waits for it between two tokens
        self.scheduler.observe_step(out, time.perf_counter() - began)
        return out

    def _schedule(self) -> SchedulerOutput:
        """The scheduler's plan; its connector moves second-tier pages before anything writes;
        what can never be scheduled fails; an idle engine waits briefly for tier loads."""
        out = self.scheduler.schedule()
        connector = self.scheduler.connector
        if connector is not None:
            failed = connector.start_step(out.page_loads)
            for seq in [s for s in self.scheduler.iter_live() if s.seq_id in failed]:
                self.output.fail(seq.request_id, EngineError(
                    "loading cached KV for this request failed; it was stopped", code="request_failed"))
        for seq in out.unschedulable:
            self.output.fail(seq.request_id, EngineError(
                "the request does not fit in the free KV pages (pinned pages hold the rest)",
                code="kv_cache_full"))
        if out.is_empty and connector is not None and self.scheduler.waiting:
            connector.wait_for_loads()  # only requests waiting on loads: new ones wait no longer
        return out

    def _execute(self, out: SchedulerOutput) -> StepForward:
        """The forward, with fault isolation (isolation.execute_isolated); the culprits'
        requests fail here, before commit, so that their chunks' K/V never becomes cached."""
        self.counters.num_steps += 1
        # constrained rows' grammar states are final now: fill their masks during the forward
        masks = StepMasks(out.chunks, self.grammars.masker)
        began = time.perf_counter()
        try:
            # the scheduler's chunks are the runner's input records (runner.RunnerChunk)
            logits, culprits = execute_isolated(self.runner.execute, list(out.chunks), out.copy_pairs,
                                                self.runner.vocab_size)
            self.counters.time_forward(out.num_tokens, time.perf_counter() - began)
        finally:
            masks.wait()
        for i in culprits:
            self.output.fail(out.chunks[i].seq.request_id,
                             isolated_failure("the model step failed on this request"))
        return StepForward(logits, frozenset(out.chunks[i].seq.seq_id for i in culprits), masks)

    def _update(self, out: SchedulerOutput, forward: StepForward) -> None:
        """Verify drafts, commit the step, sample, and turn the tokens into deltas."""
        verified = self.sampler.verify_drafts(out, forward) if self.scheduler.drafter else {}
        self.scheduler.commit(out)
        self.counters.count_chunks(out.chunks)
        sampled = self.sampler.sample_step(out, forward, verified)
        self.output.emit_sampled(sampled)
        self.output.emit_verified(verified)

    def _fork(self, parent: Sequence) -> list[Sequence]:
        """n > 1: the prompt is computed once; choices 1..n-1 share its pages (copy-on-write)."""
        children = self.output.fork_choices(parent)
        for child in children:
            self.scheduler.fork(parent, child)
        copies = self.kv.take_state_copies()  # a hybrid model's children start from its state
        if copies:
            self.runner.copy_states(copies)  # type: ignore[attr-defined]
        return children

    # ------------------------------------------------------------------ failures

    def fail_all(self, error: EngineError) -> None:
        """After an unexpected runner failure: fail every request, release every page."""
        self.output.fail_all(error)

    def recover(self, error: EngineError) -> None:
        """After a step failed as a whole (the model or device): fail every request and return
        to a clean state — no sequence left in the scheduler or the cache, invariants checked."""
        self.fail_all(error)
        # pages a tier load was installed in, if the step failed before writing it
        self.kv.forget_unwritten()
        for seq in list(self.scheduler.iter_live()):  # sequences of no known request
            self.scheduler.remove_request(seq.request_id)
        self.kv.release_everything()
