"""The synchronous engine core: requests in, one step at a time, deltas out.

Single-threaded by design: the async front (engine.py) owns the only thread that calls
``step()``. The scheduler decides, the runner computes, the sampler picks, and this file turns
tokens into per-choice deltas (incremental text, stop strings, finish reasons, usage).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch

from prefixgate.cache import KVCacheManager, make_extra_keys
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
from prefixgate.gateway.engine.config import EngineConfig, step_token_budget
from prefixgate.gateway.engine.drafter import DraftState, NgramDrafter
from prefixgate.gateway.engine.grammar import (
    CompiledGrammar,
    GrammarCompiler,
    Matcher,
    TokenMasker,
    new_matcher,
)
from prefixgate.gateway.engine.grammar.drafts import GrammarDrafts, draft_bitmask
from prefixgate.gateway.engine.kv_tier import KVTier
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
from prefixgate.gateway.engine.stop_strings import StopStringMatcher

logger = logging.getLogger("prefixgate.engine")

Sink = Callable[[Delta | EngineError], None]


class RunnerLike(Protocol):
    num_pages: int
    page_size: int
    max_model_len: int
    vocab_size: int

    def execute(self, chunks: list[Any], copy_pairs: list[tuple[int, int]] = ...) -> torch.Tensor: ...


class DecoderLike(Protocol):
    def feed(self, token_id: int) -> str: ...

    def flush(self) -> str: ...


@dataclass(slots=True)
class _ChoiceState:
    decoder: DecoderLike
    stops: StopStringMatcher
    generator: torch.Generator | None
    matcher: Matcher | None = None  # a constrained row: its grammar state


@dataclass(slots=True)
class _RequestState:
    request: GenerationRequest
    sink: Sink
    extra_keys: bytes
    seqs: list[Sequence] = field(default_factory=list)
    num_finished: int = 0
    pin_when_done: bool = False
    grammar: CompiledGrammar | None = None


class LLMEngine:
    """Continuous-batching engine over a paged KV cache.

    Args:
        runner: computes logits for scheduled chunks (gateway.engine.runner.ModelRunner).
        tokenizer: encode/decode + ``incremental_decoder()`` + ``eos_token_ids``.
        config: EngineConfig (page size, budgets, watermark, caching on/off, hash seed).
        model_id: enters the block hash (a cache never serves another model's KV).
        chunk_factory: builds the runner's chunk record from (token_ids, start_pos,
            block_table, need_logits); defaults to gateway.engine.runner.SeqChunk.
        event_sink: BlockStored / BlockRemoved (the Redis index mirror).
    """

    def __init__(
        self,
        runner: RunnerLike,
        tokenizer: Any,
        config: EngineConfig,
        *,
        model_id: str = "",
        chunk_factory: Callable[..., Any] | None = None,
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
        )
        device_type = torch.device(getattr(runner, "device", "cpu")).type
        # the second tier: evicted cached pages are spilled there and loaded back on a hit
        self.tier = KVTier(tier_store, runner.kv_pool) if tier_store is not None else None  # type: ignore[attr-defined]
        if self.tier is not None:
            self.cache.capture_evictions()
        self.scheduler = Scheduler(
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
            drafter=(NgramDrafter(config.num_speculative_tokens, self.max_model_len)
                     if config.num_speculative_tokens else None),
            max_spec_rows=config.speculative_max_rows,
        )
        if chunk_factory is None:
            from prefixgate.gateway.engine.runner import SeqChunk

            chunk_factory = SeqChunk
        self._make_chunk = chunk_factory
        self._requests: dict[str, _RequestState] = {}
        self.eos_token_ids = frozenset(getattr(tokenizer, "eos_token_ids", ()))
        self.prefill_tokens_computed = 0
        self.decode_tokens = 0
        self.num_steps = 0
        self._grammars: GrammarCompiler | None = None  # built on the first constrained request
        self._masker: TokenMasker | None = None
        self.constrained_tokens = 0
        self.tier_tokens_loaded = 0  # prompt tokens loaded from the second tier, not recomputed
        self.spec_tokens_accepted = 0  # draft tokens emitted (speculative decoding)
        self.seconds_per_token = 0.0  # moving average of a prefill-sized step's time per token

    # ------------------------------------------------------------------ grammars

    @property
    def grammars(self) -> GrammarCompiler:
        """The grammar compiler for this model's tokenizer (thread-safe; built on first use)."""
        if self._grammars is None:
            self._grammars = GrammarCompiler(self.tokenizer, self.runner.vocab_size,
                                             sorted(self.eos_token_ids))
        return self._grammars

    def grammar_stats(self) -> dict[str, float]:
        """Compile-cache figures for EngineStats (zeros before the first grammar)."""
        stats = self._grammars.stats if self._grammars is not None else None
        return {
            "grammar_compiles": stats.misses if stats else 0,
            "grammar_cache_hits": stats.hits if stats else 0,
            "grammar_compile_seconds": stats.compile_seconds if stats else 0.0,
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
        state = _RequestState(request, sink, self.extra_keys_for(request.tenant, request.cache_salt),
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
        out = self.scheduler.schedule()
        if self.tier is not None:
            self._move_tier_pages(out)
        for seq in out.unschedulable:
            self._fail(seq.request_id, EngineError(
                "the request does not fit in the free KV pages (pinned pages hold the rest)",
                code="kv_cache_full"))
        if out.is_empty:
            if self.tier is not None and self.scheduler.waiting:
                # only requests waiting on tier loads: sleep until one lands (a few ms at most:
                # new requests wait no longer), not spin and starve the load worker of the GIL
                self.tier.load_done.wait(0.005)
                self.tier.load_done.clear()
            return out
        self.num_steps += 1
        chunks = [self._make_chunk(c.token_ids, c.start_pos, c.block_table, c.need_logits,
                                   num_logits=1 + len(c.draft_ids))
                  if c.draft_ids else self._make_chunk(c.token_ids, c.start_pos, c.block_table, c.need_logits)
                  for c in out.chunks]
        # Constrained rows' grammar states are final now: fill their masks during the forward.
        # (a verify chunk's masks, one per draft position, are filled in _verify_drafts)
        constrained = [c.seq for c in out.chunks
                       if c.need_logits and c.seq.state.matcher is not None and not c.draft_ids]
        masks = self._mask_filler().start([s.state.matcher for s in constrained]) if constrained else None
        began = time.perf_counter()
        try:
            logits, culprits = self._execute(chunks, out.copy_pairs)
            if out.num_tokens >= 32:  # prefill-sized steps: the recompute cost a tier hit saves
                per_token = (time.perf_counter() - began) / out.num_tokens
                self.seconds_per_token = per_token if not self.seconds_per_token else (
                    0.9 * self.seconds_per_token + 0.1 * per_token)
        finally:
            bitmask = masks.result() if masks is not None else None
        for i in culprits:  # before commit: their chunks' K/V never becomes cached
            self._fail(out.chunks[i].seq.request_id, EngineError(
                "the model step failed on this request; it was stopped (other requests in the "
                "step were not affected)", code="request_failed"))
        mask_row = {s.seq_id: i for i, s in enumerate(constrained)}
        verified = self._verify_drafts(out, logits, culprits) if self.scheduler.drafter else {}
        self.scheduler.commit(out)
        for c in out.chunks:
            if c.seq.num_prompt_tokens > c.start_pos:
                self.prefill_tokens_computed += min(c.num_tokens, c.seq.num_prompt_tokens - c.start_pos)
            self.decode_tokens += max(0, c.start_pos + c.num_tokens - max(c.start_pos, c.seq.num_prompt_tokens))

        rows: list[SampleRow] = []
        row_seqs: list[Sequence] = []
        row_logits: list[int] = []
        row_masks: list[int] = []  # per row: its bitmask row, -1 = free
        logit_row = 0
        for c in out.chunks:
            if not c.need_logits:
                continue
            # a verify chunk has a row per draft token too; its tokens are picked already
            seq, index = c.seq, logit_row
            logit_row += 1 + len(c.draft_ids)
            if seq.status is not SeqStatus.RUNNING or seq.seq_id in verified:
                continue
            family = [seq]
            if seq.num_choices_to_fork:
                family += self._fork_choices(seq)
            for member in family:
                rows.append(SampleRow(member.sampling, member.token_ids, member.num_prompt_tokens,
                                      member.state.generator))
                row_seqs.append(member)
                row_logits.append(index)
                # forked choices start in the parent's (initial) grammar state: its mask row
                row_masks.append(mask_row.get(seq.seq_id, -1))
        if rows:
            if len(row_logits) == logits.shape[0] and row_logits == list(range(len(row_logits))):
                # every logits row samples once, in order: the usual step. NOTE: no copy of
                # [rows, vocab] then: that copy was a large part of a CPU decode step's Python
                # overhead (benchmarks.step_overhead; docs/benchmarks.md)
                picked = logits
            else:
                picked = logits.index_select(0, torch.tensor(row_logits, device=logits.device))
            token_bitmask = None
            if bitmask is not None and any(m >= 0 for m in row_masks):
                token_bitmask = self._row_bitmask(bitmask, row_masks, picked.device)
            sampled = self._sample(picked.float(), rows, token_bitmask)
            for i, seq in enumerate(row_seqs):
                if seq.request_id not in self._requests:
                    continue  # failed earlier in this loop (another choice of it)
                if sampled[i] is None:
                    self._fail(seq.request_id, EngineError(
                        "sampling failed on this request's parameters; it was stopped (other "
                        "requests in the step were not affected)", code="request_failed"))
                    continue
                token_id, token_logprob, top_ids, top_lps, dead_end = sampled[i]
                if dead_end:
                    self._fail(seq.request_id, EngineError(
                        "the output grammar allows no next token (a dead end); the request "
                        "was stopped", code="grammar_dead_end"))
                    continue
                try:
                    logprob = None
                    if token_logprob is not None and seq.sampling.logprobs:
                        logprob = self._logprob(token_id, token_logprob,
                                                top_ids[: seq.sampling.top_logprobs],
                                                top_lps[: seq.sampling.top_logprobs])
                    self._on_token(seq, token_id, logprob)
                except Exception:  # detokenizer, stop strings, grammar: this row's alone
                    self._fail_decoding(seq)
        for seq, result in verified.values():
            if seq.status is not SeqStatus.RUNNING or seq.request_id not in self._requests:
                continue
            try:
                self._on_drafts(seq, result)
            except Exception:
                self._fail_decoding(seq)
        return out

    def _fail_decoding(self, seq: Sequence) -> None:
        logger.exception("request %s failed after sampling; failing it alone", seq.request_id)
        self._fail(seq.request_id, EngineError(
            "decoding this request's output failed; it was stopped (other "
            "requests in the step were not affected)", code="request_failed"))

    def _verify_drafts(self, out: SchedulerOutput, logits: torch.Tensor, culprits: list[int]
                       ) -> dict[int, tuple[Sequence, Verified]]:
        """Verify this step's draft tokens (sampler.verify): per sequence, the drafts accepted
        and the token after them, picked here instead of by the step's sampling.

        NOTE: exact for greedy and sampled rows alike: greedy accepts the drafts that are the
        argmax after the one before; sampled rows use rejection sampling against the sampler's
        own distribution (penalties included: each row sees the drafts before it), so every
        emitted token is distributed as a plain decode's, from the same logits position a plain
        decode would compute (up to the summation order of a chunk). Rejected drafts leave
        no trace: their K/V is never committed (Scheduler.accept_drafts)."""
        assert self.scheduler.drafter is not None
        spans: list[tuple[ScheduledChunk, int]] = []
        row = 0
        failed = {out.chunks[i].seq.seq_id for i in culprits}
        for c in out.chunks:
            if not c.need_logits:
                continue
            if c.draft_ids and c.seq.seq_id not in failed and c.seq.status is SeqStatus.RUNNING:
                spans.append((c, row))
            row += 1 + len(c.draft_ids)
        bitmask = None
        if any(c.seq.state.matcher is not None for c, _ in spans):
            spans, bitmask = self._draft_masks(spans)
        if not spans:
            return {}
        index = torch.tensor([r + i for c, r in spans for i in range(1 + len(c.draft_ids))],
                             device=logits.device)
        rows: list[SampleRow] = []
        for c, _ in spans:
            seq = c.seq
            penalised = has_penalties(seq.sampling)
            for i in range(1 + len(c.draft_ids)):
                # penalties count the tokens before each position: the drafts ahead of it too
                tokens = [*seq.token_ids, *c.draft_ids[:i]] if penalised and i else seq.token_ids
                rows.append(SampleRow(seq.sampling, tokens, seq.num_prompt_tokens, seq.state.generator))
        if bitmask is not None:
            bitmask = bitmask.to(logits.device)
        results = self._verify(logits.index_select(0, index).float(), rows,
                               [c.draft_ids for c, _ in spans], bitmask)
        verified: dict[int, tuple[Sequence, Verified]] = {}
        for (c, _), result in zip(spans, results, strict=True):
            if result is None:
                self._fail(c.seq.request_id, EngineError(
                    "sampling failed on this request's parameters; it was stopped (other "
                    "requests in the step were not affected)", code="request_failed"))
                continue
            verified[c.seq.seq_id] = (c.seq, result)
            self.scheduler.drafter.record(c.seq.draft, len(c.draft_ids), result.num_accepted)
        return verified

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
                self._fail(c.seq.request_id, EngineError(
                    "the output grammar failed on this request's draft tokens; it was stopped "
                    "(other requests in the step were not affected)", code="request_failed"))
                continue
            kept.append((c, row))
        return kept, torch.cat(masks) if masks else None

    @staticmethod
    def _verify(logits: torch.Tensor, rows: list[SampleRow], drafts: list[tuple[int, ...]],
                token_bitmask: torch.Tensor | None = None) -> list[Verified | None]:
        """sampler.verify over every draft chunk; if it raises, each sequence alone (None: it
        fails alone), as ``_sample`` does. Seeded generators are rewound before the retry, so a
        sequence's draws are the ones the batched call would have made."""
        generators = {id(r.generator): r.generator for r in rows if r.generator is not None}
        states = {key: g.get_state() for key, g in generators.items()}
        try:
            return list(verify(logits, rows, drafts, token_bitmask))
        except Exception:
            logger.exception("batched verification of %d drafts failed; verifying one by one", len(drafts))
        for key, g in generators.items():
            g.set_state(states[key])
        out: list[Verified | None] = []
        at = 0
        for draft in drafts:
            end = at + len(draft) + 1
            try:
                masks = token_bitmask[at:end] if token_bitmask is not None else None
                out.append(verify(logits[at:end], rows[at:end], [draft], masks)[0])
            except Exception:
                logger.exception("verification failed for one sequence (%s)", rows[at].params)
                out.append(None)
            at = end
        if len(drafts) > 1 and all(r is None for r in out):
            raise RuntimeError("the verification fails on every row: not a per-request failure")
        return out

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
                    self._fail(seq.request_id, EngineError(
                        "the output grammar allows no next token (a dead end); the request "
                        "was stopped", code="grammar_dead_end"))
                    return
            self._on_token(seq, token_id, logprob)
            self.spec_tokens_accepted += i < result.num_accepted
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
                self.tier_tokens_loaded += len(load.page_ids) * self.page_size
        self.cache.loads_written()

    # ------------------------------------------------------------------ fault isolation

    def _execute(self, chunks: list[Any], copy_pairs: tuple[tuple[int, int], ...]
                 ) -> tuple[torch.Tensor, list[int]]:
        """Run the forward; if it raises, find the chunks that fail it alone (bisection).

        Returns the logits of every chunk with ``need_logits`` (in order; a zero row for a
        culprit) and the indexes of the culprit chunks, whose requests the caller fails.

        Raises the forward's exception when no part of the step can run (the model or device
        itself failed): the caller fails everything and recovers.

        NOTE: a re-run is safe because each chunk writes only its own pages: a copy-on-write
        pair is re-run with the chunk that owns its destination page, restoring the shared
        part before the chunk rewrites the same K/V. Matchers are not touched here (they
        advance only after sampling), so nothing is advanced twice.
        """
        try:
            return self.runner.execute(chunks, list(copy_pairs)), []
        except Exception as exc:
            first_error = exc
            logger.exception("the forward of a %d-chunk step failed; isolating the culprit", len(chunks))
        owner = {page: i for i, c in enumerate(chunks) for page in c.block_table}
        rows: dict[int, torch.Tensor] = {}
        culprits: list[int] = []
        runs = {"ok": 0, "failed": 1}
        # a dead model fails every run: give up once a bisection path fails with no success
        limit = 2 * len(chunks).bit_length() + 2

        def run(indexes: list[int]) -> None:
            try:
                picked = set(indexes)
                logits = self.runner.execute(
                    [chunks[i] for i in indexes], [p for p in copy_pairs if owner.get(p[1]) in picked])
            except Exception:
                runs["failed"] += 1
                if len(indexes) == 1:
                    culprits.append(indexes[0])
                    return
                if not runs["ok"] and runs["failed"] > limit:
                    raise first_error from None
                half = len(indexes) // 2
                run(indexes[:half])
                run(indexes[half:])
                return
            runs["ok"] += 1
            at = 0
            for i in indexes:
                if chunks[i].need_logits:
                    count = getattr(chunks[i], "num_logits", 1)  # > 1: a draft verify chunk
                    rows[i] = logits[at : at + count]
                    at += count

        if len(chunks) == 1:
            raise first_error
        half = len(chunks) // 2
        run(list(range(half)))
        run(list(range(half, len(chunks))))
        if not runs["ok"]:
            raise first_error
        like = next(iter(rows.values())) if rows else None
        sampling = [i for i, c in enumerate(chunks) if c.need_logits]
        if like is None:
            return torch.empty((0, self.runner.vocab_size)), culprits
        logits = torch.cat([
            rows[i] if i in rows else like.new_zeros((getattr(chunks[i], "num_logits", 1), like.shape[1]))
            for i in sampling])
        return logits, culprits

    @staticmethod
    def _sample(logits: torch.Tensor, rows: list[SampleRow], token_bitmask: torch.Tensor | None
                ) -> list[tuple[int, float | None, list[int], list[float], bool] | None]:
        """Sample every row: (token, its logprob, top ids, top logprobs, dead end) per row.

        If the batched sampler raises, each row is sampled alone so that only the rows that
        fail alone (None) lose their request. Alone or batched, a row's token is the same: each
        row's filters, penalties and seeded generator are its own (an unseeded row draws fresh
        noise either way). NOTE: the batched call may have masked ``logits`` in place; masking
        twice is a no-op, and nothing else in the sampler writes to its input.
        """
        try:
            return _unpack(sample(logits, rows, token_bitmask), len(rows))
        except Exception:
            logger.exception("batched sampling of %d rows failed; sampling row by row", len(rows))
        out: list[tuple[int, float | None, list[int], list[float], bool] | None] = []
        for i, row in enumerate(rows):
            mask = token_bitmask[i : i + 1] if token_bitmask is not None else None
            try:
                out.append(_unpack(sample(logits[i : i + 1], [row], mask), 1)[0])
            except Exception:
                logger.exception("sampling failed for one row (%s)", row.params)
                out.append(None)
        if len(rows) > 1 and all(r is None for r in out):
            raise RuntimeError("the sampler fails on every row: not a per-request failure")
        return out

    # ------------------------------------------------------------------ internals

    def _mask_filler(self) -> TokenMasker:
        if self._masker is None:
            self._masker = TokenMasker(self.grammars.vocab_size)
        return self._masker

    @staticmethod
    def _row_bitmask(bitmask: torch.Tensor, row_masks: list[int], device: torch.device) -> torch.Tensor:
        """One bitmask row per sampled row: its grammar's, or all ones (-1) for a free row."""
        if row_masks == list(range(bitmask.shape[0])):  # every row constrained, in fill order
            return bitmask.to(device)
        full = torch.full((len(row_masks), bitmask.shape[1]), -1, dtype=torch.int32)
        taken = [i for i, m in enumerate(row_masks) if m >= 0]
        full[taken] = bitmask[[row_masks[i] for i in taken]]
        return full.to(device)

    def _new_sequence(self, state: _RequestState, choice: int, token_ids: list[int]) -> Sequence:
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
        seq.state = _ChoiceState(
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
                                   grammar=GrammarDrafts(matcher) if matcher is not None else None)
        state.seqs.append(seq)
        return seq

    def _fork_choices(self, parent: Sequence) -> list[Sequence]:
        """n > 1: the prompt is computed once; choices 1..n-1 share its pages (copy-on-write)."""
        state = self._requests[parent.request_id]
        children = []
        for choice in range(1, parent.num_choices_to_fork + 1):
            child = self._new_sequence(state, choice, list(parent.token_ids))
            self.scheduler.fork(parent, child)
            children.append(child)
        parent.num_choices_to_fork = 0
        return children

    def _logprob(self, token_id: int, logprob: float, top_ids: list[int], top_lps: list[float]) -> TokenLogprob:
        text = self.tokenizer.decode([token_id], skip_special_tokens=False)
        top = tuple(TopLogprob(t, self.tokenizer.decode([t], skip_special_tokens=False), lp)
                    for t, lp in zip(top_ids, top_lps, strict=True))
        return TokenLogprob(token_id, text, logprob, top)

    def _on_token(self, seq: Sequence, token_id: int, logprob: TokenLogprob | None) -> None:
        sp = seq.sampling
        st: _ChoiceState = seq.state
        if st.matcher is not None:
            self.constrained_tokens += 1
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
        if finish is None and (seq.num_output_tokens >= sp.max_tokens or len(seq.token_ids) >= self.max_model_len):
            finish = "length"
        if finish == "length":
            text += st.stops.feed(st.decoder.flush())[0] + st.stops.flush()
        self._emit(seq, (token_id,), text, finish, (logprob,) if logprob is not None else None)

    def _emit(self, seq: Sequence, token_ids, text: str, finish, logprobs) -> None:
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
        state.sink(Delta(seq.choice, tuple(token_ids), text, finish, logprobs, usage))

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
        for seq_id in list(self.cache._seqs):  # noqa: SLF001 (no public listing of sequences)
            self.cache.free(seq_id)
        try:
            self.cache.check_integrity()
        except Exception:
            logger.exception("the KV cache failed its integrity check after a failed step; "
                             "dropping its cached hashes")
            self.cache.reset_cache()
            self.cache.check_integrity()


def _unpack(result: Any, num_rows: int) -> list[tuple[int, float | None, list[int], list[float], bool]]:
    """A SampleResult as one tuple per row."""
    return [
        (result.token_ids[i],
         result.logprobs[i] if result.logprobs is not None else None,
         result.top_ids[i] if result.top_ids is not None else [],
         result.top_logprobs[i] if result.top_logprobs is not None else [],
         bool(result.dead_ends and result.dead_ends[i]))
        for i in range(num_rows)
    ]
