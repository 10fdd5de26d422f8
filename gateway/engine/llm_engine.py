"""The synchronous engine core: requests in, one step at a time, deltas out.

Single-threaded by design: the async front (engine.py) owns the only thread that calls
``step()``. A step has four phases (docs/engine.md): schedule (the scheduler decides) ->
execute (the runner computes, with fault isolation) -> sample/verify (the sampler picks, each
row isolated) -> update (commit the step, turn tokens into per-choice deltas: incremental text,
stop strings, finish reasons, usage).
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Any, NamedTuple, Protocol

import torch

from prefixgate.cache import KVCacheManager, StateSlots, make_extra_keys
from prefixgate.cache.events import EventSink
from prefixgate.cache.tier import TierStore
from prefixgate.gateway.engine.api import (
    ContextLengthError,
    Delta,
    EngineError,
    GenerationRequest,
    GrammarSpec,
    InvalidRequestError,
    OverloadedError,
    TokenLogprob,
    TopLogprob,
    Usage,
)
from prefixgate.gateway.engine.config import (
    EngineConfig,
    decode_slowdown,
    decode_token_budget,
    short_prefill_budget,
    step_token_budget,
)
from prefixgate.gateway.engine.drafter import DraftState, NgramDrafter
from prefixgate.gateway.engine.grammar import (
    CompiledGrammar,
    GrammarCompiler,
    TokenMasker,
    new_matcher,
)
from prefixgate.gateway.engine.grammar.drafts import (
    GrammarDrafts,
    draft_bitmask,
    jump_forward_allowed,
)
from prefixgate.gateway.engine.grammar.worker_pool import CompileLimits
from prefixgate.gateway.engine.isolation import (
    execute_isolated,
    grammar_dead_end,
    isolated_failure,
    per_row,
)
from prefixgate.gateway.engine.kv_tier import KVTier
from prefixgate.gateway.engine.request_state import DecodeState, RequestState, Sink
from prefixgate.gateway.engine.sampler import (
    SampleRow,
    Verified,
    has_penalties,
    make_generator,
    sample,
    verify,
)
from prefixgate.gateway.engine.scheduler import ScheduledChunk, Scheduler, SchedulerOutput
from prefixgate.gateway.engine.sequence import SeqStatus, Sequence
from prefixgate.gateway.engine.state_tier import StateTier
from prefixgate.gateway.engine.step_counters import StepCounters, counter
from prefixgate.gateway.engine.step_masks import StepMasks
from prefixgate.gateway.engine.step_pacing import StepPacer
from prefixgate.gateway.engine.stop_strings import StopStringMatcher

logger = logging.getLogger("prefixgate.engine")
# the grammar compiler is built on first use, from whichever executor thread asks first
_GRAMMARS_LOCK = threading.Lock()

__all__ = ["LLMEngine", "RunnerLike", "Sink"]


class RunnerLike(Protocol):
    num_pages: int
    page_size: int
    max_model_len: int
    vocab_size: int

    def execute(self, chunks: list[Any], copy_pairs: list[tuple[int, int]] = ...) -> torch.Tensor: ...


class SampledToken(NamedTuple):
    """One sampled row: the token, its logprob and top alternatives (when asked for)."""

    token_id: int
    logprob: float | None
    top_ids: list[int]
    top_logprobs: list[float]
    dead_end: bool  # the row's grammar allowed no token: its request fails


class VerifiedDrafts(NamedTuple):
    """A draft verify chunk's outcome: the drafts accepted and the token after them."""

    seq: Sequence
    result: Verified


class StepForward(NamedTuple):
    """The execute phase's output."""

    logits: torch.Tensor  # [rows of the chunks that sample, V]; zero rows for a culprit's
    failed_seq_ids: frozenset[int]  # culprits: their requests failed already
    masks: StepMasks  # the constrained plain rows' grammar masks


class SampleBatch(NamedTuple):
    """The rows the sampler picks a token for this step (verify chunks' are picked already)."""

    rows: list[SampleRow]
    seqs: list[Sequence]  # per row (n > 1: forked choices share their parent's logits row)
    logit_rows: list[int]  # per row: its row of the step's logits
    mask_rows: list[int]  # per row: its row of the step's grammar bitmask, -1 = free


class LLMEngine:
    """Continuous-batching engine over a paged KV cache.

    Args:
        runner: computes logits for scheduled chunks (gateway.engine.runner.ModelRunner).
        tokenizer: encode/decode + ``incremental_decoder()`` + ``eos_token_ids``.
        config: EngineConfig (page size, budgets, watermark, caching on/off, hash seed).
        model_id: enters the block hash (a cache never serves another model's KV).
        event_sink: BlockStored / BlockRemoved (the Redis index mirror).
    """

    num_steps = counter("num_steps")
    prefill_tokens_computed = counter("prefill_tokens_computed")
    decode_tokens = counter("decode_tokens")
    constrained_tokens = counter("constrained_tokens")
    tier_tokens_loaded = counter("tier_tokens_loaded")
    spec_tokens_accepted = counter("spec_tokens_accepted")
    seconds_per_token = counter("seconds_per_token")

    def __init__(
        self,
        runner: RunnerLike,
        tokenizer: Any,
        config: EngineConfig,
        *,
        model_id: str = "",
        event_sink: EventSink | None = None,
        tier_store: TierStore | None = None,
    ):
        self.runner = runner
        self.tokenizer = tokenizer
        self.config = config
        self.model_id = model_id
        self.page_size = runner.page_size
        self.max_model_len = min(config.max_model_len or runner.max_model_len, runner.max_model_len)
        self.cache = KVCacheManager(
            runner.num_pages,
            runner.page_size,
            enable_caching=config.enable_prefix_caching,
            watermark=config.watermark,
            hash_seed=config.hash_seed,
            event_sink=event_sink,
            state_slots=self._state_slots(runner, config),
        )
        # the second tier: evicted cached pages are spilled there and loaded back on a hit
        self.tier = KVTier(tier_store, runner.kv_pool) if tier_store is not None else None  # type: ignore[attr-defined]
        if self.tier is not None:
            self.cache.capture_evictions()
            if self.cache.state is not None:  # a hybrid's evicted checkpoints go to host memory too
                self.cache.attach_state_tier(StateTier(runner.states, runner.num_state_slots))
        self.scheduler = self._build_scheduler()
        self._requests: dict[str, RequestState] = {}
        self.eos_token_ids = frozenset(getattr(tokenizer, "eos_token_ids", ()))
        self.counters = StepCounters()
        self._grammars: GrammarCompiler | None = None  # built on the first constrained request
        self._masker: TokenMasker | None = None

    @staticmethod
    def _state_slots(runner: Any, config: EngineConfig) -> StateSlots | None:
        """A hybrid model's state group over the runner's slots (None for other models)."""
        if not getattr(runner, "is_hybrid", False):
            return None
        return StateSlots(runner.num_state_slots, config.state_checkpoint_every)

    def _build_scheduler(self) -> Scheduler:
        config, runner = self.config, self.runner
        device_type = torch.device(getattr(runner, "device", "cpu")).type
        return Scheduler(
            self.cache,
            max_num_batched_tokens=step_token_budget(config, device_type),
            max_num_seqs=config.max_num_seqs,
            enable_dedup=config.enable_prefix_caching,
            # CPU steps are compute-bound: count attention by the model's attention-vs-linear
            # FLOP ratio. NOTE: not on GPU until measured there (small-model GPU steps are
            # dominated by per-step overhead; smaller long-context chunks could cost more).
            # Stand-in runners have no ratio.
            context_scale=(
                getattr(runner, "attention_context_scale", None) if device_type == "cpu" else None
            ),
            tier=self.tier,
            # NOTE: not for hybrid models: a rejected draft would have advanced their
            # recurrent state, which (unlike K/V past num_computed) cannot be rolled back
            drafter=(NgramDrafter(config.num_speculative_tokens, self.max_model_len)
                     if config.num_speculative_tokens and self.cache.state is None else None),
            max_spec_rows=config.speculative_max_rows,
            decode_step_budget=decode_token_budget(config, device_type),
            short_prefill_budget=short_prefill_budget(config, device_type),
            protect_waiting=config.protect_waiting,
            admission_order=config.admission_order,
            max_admission_wait_s=config.max_admission_wait_s,
            pacer=self._build_pacer(config, device_type),
        )

    @staticmethod
    def _build_pacer(config: EngineConfig, device_type: str) -> StepPacer | None:
        slowdown = decode_slowdown(config, device_type)
        if slowdown is None:
            return None
        logger.info("step pacing: a step with decodes is held to %gx the decodes' own step", slowdown)
        return StepPacer(slowdown)

    # ------------------------------------------------------------------ grammars

    @property
    def grammars(self) -> GrammarCompiler:
        """The grammar compiler for this model's tokenizer (thread-safe; built on first use)."""
        with _GRAMMARS_LOCK:  # executor threads compile concurrently: build it once
            if self._grammars is None:
                self._grammars = self._new_grammar_compiler()
        return self._grammars

    def close_grammars(self) -> None:
        """Stop the grammar-compile workers (a later constrained request starts new ones)."""
        if self._grammars is not None:
            self._grammars.close()

    def _new_grammar_compiler(self) -> GrammarCompiler:
        config = self.config
        limits = CompileLimits(timeout_s=config.grammar_compile_timeout_s,
                               memory_bytes=int(config.grammar_compile_memory_gb * (1 << 30)),
                               max_workers=config.grammar_workers)
        # NOTE: a stop token the output's structure writes as text (harmony's <|call|> and
        # <|return|>, engine/tokenizer.py) is the grammar's to place, so xgrammar must not
        # treat it as a stop; the engine still stops on it
        visible = frozenset(getattr(self.tokenizer, "visible_special_ids", ()))
        return GrammarCompiler(self.tokenizer, self.runner.vocab_size,
                               sorted(self.eos_token_ids - visible), limits=limits,
                               cache_bytes=int(config.grammar_cache_mb * (1 << 20)))

    def grammar_stats(self) -> dict[str, float]:
        """Compile-cache figures for EngineStats (zeros before the first grammar)."""
        stats = self._grammars.stats if self._grammars is not None else None
        return {
            "grammar_compiles": stats.misses if stats else 0,
            "grammar_cache_hits": stats.hits if stats else 0,
            "grammar_compile_seconds": stats.compile_seconds if stats else 0.0,
            "grammar_limit_failures": stats.limit_failures if stats else 0,
            "grammar_cache_bytes": self._grammars.cache.num_bytes if self._grammars else 0,
        }

    def tier_stats(self) -> dict[str, Any] | None:
        """The second tier's counters plus the recompute it saved (None without a tier).

        ``recompute_seconds_saved`` estimates the loaded tokens' prefill time from the moving
        average of prefill-sized steps' time per token."""
        if self.tier is None:
            return None
        return {
            **self.tier.stats().as_dict(),
            "tokens_loaded": self.tier_tokens_loaded,
            "recompute_seconds_saved": round(self.tier_tokens_loaded * self.seconds_per_token, 6),
            "load_waits": self.scheduler.num_tier_waits,
        }

    def tier_load_discount(self) -> float | None:
        """How much of a recompute a tier hit saves, per token: 1 - (load seconds per token /
        prefill seconds per token), clipped to [0, 1]. None until both have been measured.

        The router scores the fleet tier's blocks by this (a block that costs as much to load
        as to recompute is worth nothing there). Read without the engine lock: two floats and
        two counters, each exact at some recent instant.
        """
        if self.tier is None or not self.seconds_per_token:
            return None
        load_per_token = self.tier.load_seconds_per_token(self.page_size)
        if load_per_token is None:
            return None
        return min(1.0, max(0.0, 1.0 - load_per_token / self.seconds_per_token))

    def spec_stats(self) -> dict[str, int]:
        """Speculative decoding counters for EngineStats (zeros when it is off)."""
        drafter = self.scheduler.drafter
        return {
            "spec_drafts": drafter.num_drafts if drafter else 0,
            "spec_draft_tokens": drafter.num_proposed if drafter else 0,
            "spec_accepted_tokens": self.spec_tokens_accepted,
        }

    def compile_grammar(self, spec: GrammarSpec, tenant: str = "default") -> CompiledGrammar:
        """Compile (or fetch from ``tenant``'s cache) ``spec``; InvalidRequestError if it cannot."""
        return self.grammars.compile(spec, tenant)

    # ------------------------------------------------------------------ requests

    def extra_keys_for(self, tenant: str, cache_salt: str | None) -> bytes:
        return make_extra_keys(self.model_id, tenant, cache_salt)

    def validate(self, request: GenerationRequest) -> None:
        """Raise the error a request would hit, before it is queued."""
        prompt = request.prompt_token_ids
        sp = request.sampling
        if not prompt:
            raise InvalidRequestError("the prompt is empty", param="messages")
        vocab = self.runner.vocab_size
        bad = next((t for t in prompt if not 0 <= t < vocab), None)
        if bad is not None:
            raise InvalidRequestError(f"token id {bad} is outside the vocabulary [0, {vocab})", param="prompt")
        if sp.top_k > vocab:
            raise InvalidRequestError(f"top_k must be <= the vocabulary size {vocab}, got {sp.top_k}",
                                      param="top_k")
        bad = next((t for t in sp.stop_token_ids if not 0 <= t < vocab), None)
        if bad is not None:
            raise InvalidRequestError(f"stop token id {bad} is outside the vocabulary [0, {vocab})",
                                      param="stop_token_ids")
        if len(prompt) + sp.max_tokens > self.max_model_len:
            raise ContextLengthError(len(prompt), sp.max_tokens, self.max_model_len)
        pages = -(-(len(prompt) + sp.max_tokens) // self.page_size) + (sp.n - 1) * (
            -(-sp.max_tokens // self.page_size) + 1
        )
        if pages > self.cache.num_pages:
            raise ContextLengthError(
                len(prompt), sp.max_tokens, self.cache.num_pages * self.page_size // max(1, sp.n),
                what="KV cache capacity (all pages)",
            )

    def add_request(self, request: GenerationRequest, sink: Sink, *, pin_when_done: bool = False,
                    grammar: CompiledGrammar | None = None) -> None:
        """Queue a request; deltas (or an EngineError) go to ``sink`` from the engine thread.

        ``grammar``: ``request.grammar`` already compiled (the async front compiles off the
        engine thread); compiled here when None.
        """
        self.validate(request)
        if request.grammar is not None and grammar is None:
            grammar = self.compile_grammar(request.grammar, request.tenant)
        if request.request_id in self._requests:
            raise InvalidRequestError(f"duplicate request id {request.request_id}")
        if self.scheduler.num_waiting >= self.config.max_waiting:
            raise OverloadedError(
                f"the waiting queue is full ({self.config.max_waiting} requests); retry shortly",
                retry_after=1.0,
            )
        state = RequestState(request, sink, self.extra_keys_for(request.tenant, request.cache_salt),
                              pin_when_done=pin_when_done,
                              grammar=grammar if request.grammar is not None else None)
        seq = self._new_sequence(state, 0, list(request.prompt_token_ids))
        seq.num_choices_to_fork = request.sampling.n - 1
        self._requests[request.request_id] = state
        self.scheduler.add(seq)

    def abort(self, request_id: str) -> bool:
        """Drop a request now (client gone); its pages are released. False if unknown."""
        state = self._requests.pop(request_id, None)
        if state is None:
            return False
        self.scheduler.remove_request(request_id)
        return True

    def finish_early(self, request_id: str) -> bool:
        """End a request now as if it had stopped (finish "stop", then its usage), releasing
        its pages: the gateway ends a turn whose output went degenerate (a repeated tool call,
        gateway/server/tools/repeats.py). False if unknown (already finished or aborted)."""
        state = self._requests.get(request_id)
        if state is None or state.request.sampling.n != 1:  # n > 1: choices not forked yet
            return False
        # released as an abort releases them (waiting or running, tier loads dropped); the
        # finish below then only reports it (its scheduler.finish finds nothing left to free)
        self.scheduler.remove_request(request_id)
        for seq in list(state.seqs):
            if seq.finish_reason is None and request_id in self._requests:
                self._emit(seq, (), "", "stop", None)
        return True

    def has_work(self) -> bool:
        return self.scheduler.has_work()

    @property
    def num_requests(self) -> int:
        return len(self._requests)

    # ------------------------------------------------------------------ one step

    def step(self) -> SchedulerOutput:
        """One step: schedule -> execute -> sample/verify -> update (docs/engine.md)."""
        began = time.perf_counter()
        out = self.scheduler.schedule()
        self._prepare(out)
        if out.is_empty:
            self._wait_for_tier_loads()
            return out
        forward = self._execute_step(out)
        verified = self._verify_drafts(out, forward) if self.scheduler.drafter else {}
        self.scheduler.commit(out)
        self.counters.count_chunks(out.chunks)
        sampled = self._sample_step(out, forward, verified)
        self._emit_sampled(sampled)
        self._emit_verified(verified)
        # the whole step, as a decoding stream waits for it between two tokens
        self.scheduler.observe_step(out, time.perf_counter() - began)
        return out

    # ------------------------------------------------------------------ schedule

    def _prepare(self, out: SchedulerOutput) -> None:
        """Before anything runs: move tier pages, fail what can never be scheduled."""
        if self.tier is not None:
            self._move_tier_pages(out)
        for seq in out.unschedulable:
            self._fail(seq.request_id, EngineError(
                "the request does not fit in the free KV pages (pinned pages hold the rest)",
                code="kv_cache_full"))

    def _wait_for_tier_loads(self) -> None:
        if self.tier is not None and self.scheduler.waiting:
            # only requests waiting on tier loads: sleep until one lands (a few ms at most:
            # new requests wait no longer), not spin and starve the load worker of the GIL
            self.tier.load_done.wait(0.005)
            self.tier.load_done.clear()

    # ------------------------------------------------------------------ execute

    def _execute_step(self, out: SchedulerOutput) -> StepForward:
        """The forward, with fault isolation; the culprits' requests are failed here, before
        commit, so that their chunks' K/V never becomes cached."""
        self.counters.num_steps += 1
        # constrained rows' grammar states are final now: fill their masks during the forward
        masks = StepMasks(out.chunks, self._mask_filler)
        began = time.perf_counter()
        try:
            # the scheduler's chunks are the runner's input records (runner.RunnerChunk)
            logits, culprits = self._execute(list(out.chunks), out.copy_pairs)
            self.counters.time_forward(out.num_tokens, time.perf_counter() - began)
        finally:
            masks.wait()
        for i in culprits:
            self._fail(out.chunks[i].seq.request_id,
                       isolated_failure("the model step failed on this request"))
        return StepForward(logits, frozenset(out.chunks[i].seq.seq_id for i in culprits), masks)

    def _execute(self, chunks: list[Any], copy_pairs: tuple[tuple[int, int], ...]
                 ) -> tuple[torch.Tensor, list[int]]:
        """The logits of the step's sampling chunks and the culprit chunks' indexes
        (isolation.execute_isolated)."""
        return execute_isolated(self.runner.execute, chunks, copy_pairs, self.runner.vocab_size)

    # ------------------------------------------------------------------ verify

    def _verify_drafts(self, out: SchedulerOutput, forward: StepForward
                       ) -> dict[int, VerifiedDrafts]:
        """Verify this step's draft tokens (sampler.verify): per sequence, the drafts accepted
        and the token after them, picked here instead of by the step's sampling.

        NOTE: exact for greedy and sampled rows alike: greedy accepts the drafts that are the
        argmax after the one before; sampled rows use rejection sampling against the sampler's
        own distribution (penalties included: each row sees the drafts before it), so every
        emitted token is distributed as a plain decode's, from the same logits position a plain
        decode would compute (up to the summation order of a chunk). Rejected drafts leave
        no trace: their K/V is never committed (Scheduler.accept_drafts)."""
        assert self.scheduler.drafter is not None
        spans = self._draft_spans(out, forward.failed_seq_ids)
        bitmask = None
        if any(c.seq.state.matcher is not None for c, _ in spans):
            spans, bitmask = self._draft_masks(spans)
        if not spans:
            return {}
        logits = forward.logits
        index = torch.tensor([r + i for c, r in spans for i in range(1 + len(c.draft_ids))],
                             device=logits.device)
        rows = [row for c, _ in spans for row in self._verify_rows(c)]
        if bitmask is not None:
            bitmask = bitmask.to(logits.device)
        results = self._verify(logits.index_select(0, index).float(), rows,
                               [c.draft_ids for c, _ in spans], bitmask)
        verified: dict[int, VerifiedDrafts] = {}
        for (c, _), result in zip(spans, results, strict=True):
            if result is None:
                self._fail(c.seq.request_id,
                           isolated_failure("sampling failed on this request's parameters"))
                continue
            verified[c.seq.seq_id] = VerifiedDrafts(c.seq, result)
            self.scheduler.drafter.record(c.seq.draft, len(c.draft_ids), result.num_accepted)
        return verified

    @staticmethod
    def _draft_spans(out: SchedulerOutput, failed: frozenset[int]
                     ) -> list[tuple[ScheduledChunk, int]]:
        """The step's live verify chunks, each with its first row of the step's logits."""
        spans: list[tuple[ScheduledChunk, int]] = []
        row = 0
        for c in out.chunks:
            if not c.need_logits:
                continue
            if c.draft_ids and c.seq.seq_id not in failed and c.seq.status is SeqStatus.RUNNING:
                spans.append((c, row))
            row += 1 + len(c.draft_ids)
        return spans

    @staticmethod
    def _verify_rows(c: ScheduledChunk) -> list[SampleRow]:
        """A verify chunk's sampler rows: one per draft position and one after the drafts."""
        seq = c.seq
        penalised = has_penalties(seq.sampling)
        # penalties count the tokens before each position: the drafts ahead of it too
        return [SampleRow(seq.sampling,
                          [*seq.token_ids, *c.draft_ids[:i]] if penalised and i else seq.token_ids,
                          seq.num_prompt_tokens, seq.state.generator)
                for i in range(1 + len(c.draft_ids))]

    def _draft_masks(self, spans: list[tuple[ScheduledChunk, int]]
                     ) -> tuple[list[tuple[ScheduledChunk, int]], torch.Tensor | None]:
        """The verify rows' grammar masks, per draft position what the grammar allows once the
        drafts before it are in (all ones for a free row). A row whose grammar fails to give
        them fails its request alone and leaves the spans (as TokenMasker does for plain rows)."""
        words = self._mask_filler().num_words
        kept: list[tuple[ScheduledChunk, int]] = []
        masks: list[torch.Tensor] = []
        for c, row in spans:
            matcher = c.seq.state.matcher
            try:
                masks.append(draft_bitmask(matcher, c.draft_ids, words) if matcher is not None
                             else torch.full((1 + len(c.draft_ids), words), -1, dtype=torch.int32))
            except Exception:  # noqa: BLE001 - this row's grammar alone
                logger.exception("masking the drafts of request %s failed", c.seq.request_id)
                self._fail(c.seq.request_id,
                           isolated_failure("the output grammar failed on this request's draft tokens"))
                continue
            kept.append((c, row))
        return kept, torch.cat(masks) if masks else None

    @staticmethod
    def _verify(logits: torch.Tensor, rows: list[SampleRow], drafts: list[tuple[int, ...]],
                token_bitmask: torch.Tensor | None = None) -> list[Verified | None]:
        """sampler.verify over every draft chunk; a sequence that fails alone is None
        (isolation.per_row). Seeded generators are rewound before the retry, so a sequence's
        draws are the ones the batched call would have made."""
        generators = {id(r.generator): r.generator for r in rows if r.generator is not None}
        states = {key: g.get_state() for key, g in generators.items()}
        starts = [0]
        for draft in drafts:
            starts.append(starts[-1] + len(draft) + 1)

        def rewind() -> None:
            for key, g in generators.items():
                g.set_state(states[key])

        def one(i: int) -> Verified:
            at, end = starts[i], starts[i + 1]
            masks = token_bitmask[at:end] if token_bitmask is not None else None
            return verify(logits[at:end], rows[at:end], [drafts[i]], masks)[0]

        return per_row(lambda: list(verify(logits, rows, drafts, token_bitmask)), one,
                       len(drafts), "verification", describe=lambda i: rows[starts[i]].params,
                       before_retry=rewind)

    # ------------------------------------------------------------------ sample

    def _sample_step(self, out: SchedulerOutput, forward: StepForward,
                     verified: dict[int, VerifiedDrafts]) -> list[tuple[Sequence, SampledToken | None]]:
        """Sample one token for every running row that samples (n > 1: forked here, after
        commit, so the choices share the computed prompt's pages)."""
        batch = self._sample_batch(out, forward.masks, verified)
        if not batch.rows:
            return []
        logits = forward.logits
        if batch.logit_rows == list(range(logits.shape[0])):
            # every logits row samples once, in order: the usual step. NOTE: no copy of
            # [rows, vocab] then: that copy was a large part of a CPU decode step's Python
            # overhead (benchmarks.step_overhead; docs/benchmarks.md)
            picked = logits
        else:
            picked = logits.index_select(0, torch.tensor(batch.logit_rows, device=logits.device))
        token_bitmask = forward.masks.for_rows(batch.mask_rows, picked.device)
        return list(zip(batch.seqs, self._sample(picked.float(), batch.rows, token_bitmask),
                        strict=True))

    def _sample_batch(self, out: SchedulerOutput, masks: StepMasks,
                      verified: dict[int, VerifiedDrafts]) -> SampleBatch:
        batch = SampleBatch([], [], [], [])
        logit_row = 0
        for c in out.chunks:
            if not c.need_logits:
                continue
            # a verify chunk has a row per draft token too; its tokens are picked already
            seq, index = c.seq, logit_row
            logit_row += 1 + len(c.draft_ids)
            if seq.status is not SeqStatus.RUNNING or seq.seq_id in verified:
                continue
            family = [seq, *self._fork_choices(seq)] if seq.num_choices_to_fork else [seq]
            for member in family:
                batch.rows.append(SampleRow(member.sampling, member.token_ids,
                                            member.num_prompt_tokens, member.state.generator))
                batch.seqs.append(member)
                batch.logit_rows.append(index)
                # forked choices start in the parent's (initial) grammar state: its mask row
                batch.mask_rows.append(masks.row_of.get(seq.seq_id, -1))
        return batch

    @staticmethod
    def _sample(logits: torch.Tensor, rows: list[SampleRow], token_bitmask: torch.Tensor | None
                ) -> list[SampledToken | None]:
        """Sample every row; a row that fails alone is None (isolation.per_row).

        Alone or batched, a row's token is the same: each row's filters, penalties and seeded
        generator are its own (an unseeded row draws fresh noise either way). NOTE: the batched
        call may have masked ``logits`` in place; masking twice is a no-op, and nothing else
        in the sampler writes to its input.
        """
        def one(i: int) -> SampledToken:
            mask = token_bitmask[i : i + 1] if token_bitmask is not None else None
            return _sampled(sample(logits[i : i + 1], [rows[i]], mask))[0]

        return per_row(lambda: _sampled(sample(logits, rows, token_bitmask)), one, len(rows),
                       "sampling", describe=lambda i: rows[i].params)

    def _fork_choices(self, parent: Sequence) -> list[Sequence]:
        """n > 1: the prompt is computed once; choices 1..n-1 share its pages (copy-on-write)."""
        state = self._requests[parent.request_id]
        children = []
        for choice in range(1, parent.num_choices_to_fork + 1):
            child = self._new_sequence(state, choice, list(parent.token_ids))
            self.scheduler.fork(parent, child)
            children.append(child)
        parent.num_choices_to_fork = 0
        copies = self.cache.take_state_copies()  # a hybrid model's children start from its state
        if copies:
            self.runner.copy_states(copies)
        return children

    # ------------------------------------------------------------------ update

    def _emit_sampled(self, sampled: list[tuple[Sequence, SampledToken | None]]) -> None:
        """Each sampled token into its choice's output (the step's commit came first)."""
        for seq, token in sampled:
            if seq.request_id not in self._requests:
                continue  # failed earlier in this loop (another choice of it)
            if token is None:
                self._fail(seq.request_id,
                           isolated_failure("sampling failed on this request's parameters"))
            elif token.dead_end:
                self._fail(seq.request_id, grammar_dead_end())
            else:
                try:
                    top = seq.sampling.top_logprobs
                    logprob = None
                    if token.logprob is not None and seq.sampling.logprobs:
                        logprob = self._logprob(token.token_id, token.logprob,
                                                token.top_ids[:top], token.top_logprobs[:top])
                    self._on_token(seq, token.token_id, logprob)
                except Exception:  # detokenizer, stop strings, grammar: this row's alone
                    self._fail_decoding(seq)

    def _emit_verified(self, verified: dict[int, VerifiedDrafts]) -> None:
        for seq, result in verified.values():
            if seq.status is not SeqStatus.RUNNING or seq.request_id not in self._requests:
                continue
            try:
                self._on_drafts(seq, result)
            except Exception:
                self._fail_decoding(seq)

    def _fail_decoding(self, seq: Sequence) -> None:
        logger.exception("request %s failed after sampling; failing it alone", seq.request_id)
        self._fail(seq.request_id, isolated_failure("decoding this request's output failed"))

    def _on_drafts(self, seq: Sequence, result: Verified) -> None:
        """Emit ``seq``'s accepted draft tokens (as if decoded one by one), make their K/V the
        sequence's, then emit the token after them; stops early when one of them finishes it
        (EOS, stop, length)."""
        sp = seq.sampling
        for i, token_id in enumerate(result.token_ids):
            logprob = None
            if result.logprobs is not None and sp.logprobs:
                assert result.top_ids is not None and result.top_logprobs is not None
                logprob = self._logprob(token_id, result.logprobs[i], result.top_ids[i][: sp.top_logprobs],
                                        result.top_logprobs[i][: sp.top_logprobs])
            if i == result.num_accepted:  # the drafts are the sequence's tokens now
                self.scheduler.accept_drafts(seq, result.num_accepted)
                if result.dead_end:
                    self._fail(seq.request_id, grammar_dead_end())
                    return
            self._on_token(seq, token_id, logprob)
            self.counters.spec_tokens_accepted += i < result.num_accepted
            if seq.status is not SeqStatus.RUNNING:
                return

    def _move_tier_pages(self, out: SchedulerOutput) -> None:
        """Before anything writes this step: copy evicted pages out to the tier, then write the
        loads into their fresh pages (an evicted page may be a load's destination)."""
        assert self.tier is not None
        evicted = self.cache.take_evicted()
        if evicted:
            try:
                self.tier.spill(evicted)
            except Exception:  # noqa: BLE001 - a lost spill costs a recompute later, nothing else
                logger.exception("spilling %d evicted pages to the kv tier failed; dropped", len(evicted))
                self.tier.count_dropped(len(evicted))
        for load in out.page_loads:
            try:
                self.tier.write(load.page_ids, load.payload, load.offset)
            except Exception:  # their pages must never be read: un-cache them, fail holders
                logger.exception("writing a kv tier load failed; recomputing those blocks")
                holders = self.cache.forget_pages(load.page_ids)
                for seq in [*self.scheduler.running, *self.scheduler.waiting]:
                    if seq.seq_id in holders:
                        self._fail(seq.request_id, EngineError(
                            "loading cached KV for this request failed; it was stopped",
                            code="request_failed"))
            else:
                self.counters.tier_tokens_loaded += len(load.page_ids) * self.page_size
        self.cache.loads_written()

    # ------------------------------------------------------------------ internals

    def _mask_filler(self) -> TokenMasker:
        if self._masker is None:
            self._masker = TokenMasker(self.grammars.vocab_size)
        return self._masker

    def _new_sequence(self, state: RequestState, choice: int, token_ids: list[int]) -> Sequence:
        req = state.request
        seq = Sequence(
            request_id=req.request_id,
            choice=choice,
            token_ids=token_ids,
            num_prompt_tokens=len(req.prompt_token_ids),
            sampling=req.sampling,
            extra_keys=state.extra_keys,
            tenant=req.tenant,
            agent=req.agent,
        )
        seq.state = DecodeState(
            decoder=self.tokenizer.incremental_decoder(),
            stops=StopStringMatcher(req.sampling.stop),
            generator=make_generator(req.sampling.seed, choice),
            matcher=new_matcher(state.grammar) if state.grammar is not None else None,
        )
        sp = req.sampling
        # Greedy and sampled requests draft alike (sampler.verify: rejection sampling), with
        # penalties (each draft position is penalised for the drafts before it), logprobs (each
        # emitted token's row is the position a plain decode would have used) and seeds (each
        # emitted token consumes one draw of the request's generator, as a plain decode does,
        # so a seeded output does not depend on the batch flipping the speculative_max_rows cap).
        # Constrained rows draft too (grammar/drafts.py): the tokens their grammar forces
        # next (a tool call's structure and keys), else the n-gram proposal up to the first
        # token the grammar rejects; each verify row is masked by the grammar's state after
        # the drafts before it, so the output is the same as one token a step.
        # NOTE: not with n > 1: the prompt's last token can be scheduled as a one-token
        # "decode" (after chunked prefill or a recompute), which would draft before the
        # choices fork, and the forks sample from that chunk's first row in the step's
        # sampling, which skips verified chunks.
        if self.scheduler.drafter is not None and req.speculative and sp.n == 1:
            matcher = seq.state.matcher
            seq.draft = DraftState(k=self.scheduler.drafter.max_draft,
                                   grammar=GrammarDrafts(
                                       matcher, jump_forward=jump_forward_allowed(req.grammar))
                                   if matcher is not None and req.grammar is not None else None)
        state.seqs.append(seq)
        return seq

    def _logprob(self, token_id: int, logprob: float, top_ids: list[int], top_lps: list[float]) -> TokenLogprob:
        text = self.tokenizer.decode([token_id], skip_special_tokens=False)
        top = tuple(TopLogprob(t, self.tokenizer.decode([t], skip_special_tokens=False), lp)
                    for t, lp in zip(top_ids, top_lps, strict=True))
        return TokenLogprob(token_id, text, logprob, top)

    def _on_token(self, seq: Sequence, token_id: int, logprob: TokenLogprob | None) -> None:
        sp = seq.sampling
        st: DecodeState = seq.state
        if st.matcher is not None:
            self.counters.constrained_tokens += 1
            if not st.matcher.accept_token(token_id):
                # the mask allowed it, so the grammar itself is inconsistent: this request only
                self._fail(seq.request_id, EngineError(
                    f"the output grammar rejected token {token_id} it had allowed; the request "
                    "was stopped", code="grammar_dead_end"))
                return
        self.scheduler.append_token(seq, token_id)
        finish = None
        text = ""
        if (token_id in sp.stop_token_ids or (not sp.ignore_eos and token_id in self.eos_token_ids)
                or (st.matcher is not None and st.matcher.is_terminated())):
            finish = "stop"  # the stop token itself is not shown (a finished grammar ends too)
            # NOTE: the text held back in case it started a stop string did not: it is output
            # (a tool call's closing tag, which a stop string must not cut off)
            text, matched = st.stops.feed(st.decoder.flush())
            if not matched:
                text += st.stops.flush()
        else:
            text, matched = st.stops.feed(st.decoder.feed(token_id))
            if matched:
                finish = "stop"
        # the surfaces that name the stop string (Anthropic's stop_sequence) read it here
        matched_stop = st.stops.matched if matched else None
        if finish is None and (seq.num_output_tokens >= sp.max_tokens or len(seq.token_ids) >= self.max_model_len):
            finish = "length"
        if finish == "length":
            text += st.stops.feed(st.decoder.flush())[0] + st.stops.flush()
        self._emit(seq, (token_id,), text, finish, (logprob,) if logprob is not None else None,
                   matched_stop)

    def _emit(self, seq: Sequence, token_ids, text: str, finish, logprobs,
              matched_stop: str | None = None) -> None:
        state = self._requests.get(seq.request_id)
        if state is None:
            return
        usage = None
        if finish is not None:
            seq.finish_reason = finish
            if state.pin_when_done and seq.choice == 0:
                self.cache.pin(seq.token_ids[: seq.num_prompt_tokens], seq.extra_keys)
            self.scheduler.finish(seq)
            state.num_finished += 1
            if state.num_finished == state.request.sampling.n:
                usage = Usage(
                    prompt_tokens=len(state.request.prompt_token_ids),
                    completion_tokens=sum(s.num_output_tokens for s in state.seqs),
                    cached_tokens=state.seqs[0].num_cached_tokens or 0,
                )
                del self._requests[seq.request_id]
        state.sink(Delta(seq.choice, tuple(token_ids), text, finish, logprobs, usage,
                         matched_stop))

    def _fail(self, request_id: str, error: EngineError) -> None:
        state = self._requests.pop(request_id, None)
        if state is not None:
            self.scheduler.remove_request(request_id)
            state.sink(error)

    def fail_all(self, error: EngineError) -> None:
        """After an unexpected runner failure: fail every request, release every page."""
        for request_id in list(self._requests):
            self._fail(request_id, error)

    def recover(self, error: EngineError) -> None:
        """After a step failed as a whole (the model or device): fail every request and return
        to a clean state — no sequence left in the scheduler or the cache, invariants checked.

        A cache that fails its integrity check after that drops its unreferenced hashes
        (nothing doubtful is served; pinned pages stay).
        """
        self.fail_all(error)
        # pages a tier load was installed in, if the step failed before writing it
        self.cache.forget_unwritten()
        for seq in list(self.scheduler.iter_live()):  # sequences of no known request
            self.scheduler.remove_request(seq.request_id)
        # NOTE: a step that raised between the manager's allocate and the scheduler's bookkeeping
        # can leave a sequence only the manager knows; it would hold its pages forever
        for seq_id in self.cache.sequence_ids():
            self.cache.free(seq_id)
        self.cache.release_all_holds()
        try:
            self.cache.check_integrity()
        except Exception:
            logger.exception("the KV cache failed its integrity check after a failed step; "
                             "dropping its cached hashes")
            self.cache.reset_cache()
            self.cache.check_integrity()


def _sampled(result: Any) -> list[SampledToken]:
    """A SampleResult as one record per row."""
    return [
        SampledToken(
            result.token_ids[i],
            result.logprobs[i] if result.logprobs is not None else None,
            result.top_ids[i] if result.top_ids is not None else [],
            result.top_logprobs[i] if result.top_logprobs is not None else [],
            bool(result.dead_ends and result.dead_ends[i]),
        )
        for i in range(len(result.token_ids))
    ]
