"""The step's sample/verify phase: one token per sampling row, or a verify chunk's accepted
drafts and the token after them, each row isolated (isolation.per_row) and typed."""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any, NamedTuple

import torch

from prefixgate.engine.api import EngineError
from prefixgate.engine.grammar import TokenMasker
from prefixgate.engine.grammar.drafts import draft_bitmask
from prefixgate.engine.isolation import isolated_failure, per_row
from prefixgate.engine.sampler import SampleRow, Verified, has_penalties, sample, verify
from prefixgate.engine.scheduler import ScheduledChunk, SchedulerOutput
from prefixgate.engine.sequence import SeqStatus, Sequence
from prefixgate.engine.step_masks import StepMasks

logger = logging.getLogger("prefixgate.engine")


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


class StepSampler:
    """Picks the step's tokens from its logits.

    Args:
        masker: the engine's TokenMasker (built on first use).
        fail: ends one request with an error (its row alone).
        fork: n > 1: forks a parent's choices once its prompt is computed (after commit).
        record_drafts: the drafter's acceptance bookkeeping (None: no speculative decoding).
    """

    def __init__(self, masker: Callable[[], TokenMasker], fail: Callable[[str, EngineError], None],
                 fork: Callable[[Sequence], list[Sequence]],
                 record_drafts: Callable[[Any, int, int], None] | None = None) -> None:
        self.masker = masker
        self.fail = fail
        self.fork = fork
        self.record_drafts = record_drafts

    # ------------------------------------------------------------------ verify

    def verify_drafts(self, out: SchedulerOutput, forward: StepForward) -> dict[int, VerifiedDrafts]:
        """Verify this step's draft tokens (sampler.verify): per sequence, the drafts accepted
        and the token after them, picked here instead of by the step's sampling.

        NOTE: exact for greedy and sampled rows alike: greedy accepts the drafts that are the
        argmax after the one before; sampled rows use rejection sampling against the sampler's
        own distribution (penalties included: each row sees the drafts before it), so every
        emitted token is distributed as a plain decode's, from the same logits position a plain
        decode would compute (up to the summation order of a chunk). Rejected drafts leave
        no trace: their K/V is never committed (Scheduler.accept_drafts)."""
        assert self.record_drafts is not None
        spans = _draft_spans(out, forward.failed_seq_ids)
        bitmask = None
        if any(c.seq.state.matcher is not None for c, _ in spans):
            spans, bitmask = self._draft_masks(spans)
        if not spans:
            return {}
        logits = forward.logits
        index = torch.tensor([r + i for c, r in spans for i in range(1 + len(c.draft_ids))],
                             device=logits.device)
        rows = [row for c, _ in spans for row in _verify_rows(c)]
        if bitmask is not None:
            bitmask = bitmask.to(logits.device)
        results = _verify(logits.index_select(0, index).float(), rows,
                          [c.draft_ids for c, _ in spans], bitmask)
        verified: dict[int, VerifiedDrafts] = {}
        for (c, _), result in zip(spans, results, strict=True):
            if result is None:
                self.fail(c.seq.request_id,
                          isolated_failure("sampling failed on this request's parameters"))
                continue
            verified[c.seq.seq_id] = VerifiedDrafts(c.seq, result)
            self.record_drafts(c.seq.draft, len(c.draft_ids), result.num_accepted)
        return verified

    def _draft_masks(self, spans: list[tuple[ScheduledChunk, int]]
                     ) -> tuple[list[tuple[ScheduledChunk, int]], torch.Tensor | None]:
        """The verify rows' grammar masks, per draft position what the grammar allows once the
        drafts before it are in (all ones for a free row). A row whose grammar fails to give
        them fails its request alone and leaves the spans (as TokenMasker does for plain rows)."""
        words = self.masker().num_words
        kept: list[tuple[ScheduledChunk, int]] = []
        masks: list[torch.Tensor] = []
        for c, row in spans:
            matcher = c.seq.state.matcher
            try:
                masks.append(draft_bitmask(matcher, c.draft_ids, words) if matcher is not None
                             else torch.full((1 + len(c.draft_ids), words), -1, dtype=torch.int32))
            except Exception:  # noqa: BLE001 - this row's grammar alone
                logger.exception("masking the drafts of request %s failed", c.seq.request_id)
                self.fail(c.seq.request_id,
                          isolated_failure("the output grammar failed on this request's draft tokens"))
                continue
            kept.append((c, row))
        return kept, torch.cat(masks) if masks else None

    # ------------------------------------------------------------------ sample

    def sample_step(self, out: SchedulerOutput, forward: StepForward,
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
        return list(zip(batch.seqs, _sample(picked.float(), batch.rows, token_bitmask),
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
            family = [seq, *self.fork(seq)] if seq.num_choices_to_fork else [seq]
            for member in family:
                batch.rows.append(SampleRow(member.sampling, member.token_ids,
                                            member.num_prompt_tokens, member.state.generator))
                batch.seqs.append(member)
                batch.logit_rows.append(index)
                # forked choices start in the parent's (initial) grammar state: its mask row
                batch.mask_rows.append(masks.row_of.get(seq.seq_id, -1))
        return batch


def _draft_spans(out: SchedulerOutput, failed: frozenset[int]) -> list[tuple[ScheduledChunk, int]]:
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


def _verify_rows(c: ScheduledChunk) -> list[SampleRow]:
    """A verify chunk's sampler rows: one per draft position and one after the drafts."""
    seq = c.seq
    penalised = has_penalties(seq.sampling)
    # penalties count the tokens before each position: the drafts ahead of it too
    return [SampleRow(seq.sampling,
                      [*seq.token_ids, *c.draft_ids[:i]] if penalised and i else seq.token_ids,
                      seq.num_prompt_tokens, seq.state.generator)
            for i in range(1 + len(c.draft_ids))]


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
