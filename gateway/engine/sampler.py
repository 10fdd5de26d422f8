"""Batched sampling in torch: penalties, temperature, top-k / top-p / min-p, seeds, logprobs.

One row per sequence that needs a token this step. Rows with temperature 0 are greedy. A
per-request ``seed`` gives the row its own torch.Generator (created once per sequence), so the
same request with the same seed reproduces its output whatever else is in the batch.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from prefixgate.gateway.engine.api import SamplingParams
from prefixgate.kernels.token_bitmask import apply_token_bitmask


@dataclass(slots=True)
class SampleRow:
    """One row to sample. ``token_ids`` is the sequence's own list (prompt + output), not a
    copy: only the penalties ever look at it, so nothing is sliced per step otherwise."""

    params: SamplingParams
    token_ids: Sequence[int]
    num_prompt_tokens: int
    generator: torch.Generator | None

    @property
    def output_ids(self) -> Sequence[int]:
        return self.token_ids[self.num_prompt_tokens :]


@dataclass(frozen=True, slots=True)
class SampleResult:
    token_ids: list[int]
    logprobs: list[float] | None  # logprob of each chosen token (raw model distribution)
    top_ids: list[list[int]] | None
    top_logprobs: list[list[float]] | None
    # per row, True where a grammar allowed no token at all (the row's token is meaningless)
    dead_ends: list[bool] | None = None


def make_generator(seed: int | None, choice: int) -> torch.Generator | None:
    if seed is None:
        return None
    g = torch.Generator(device="cpu")
    g.manual_seed((seed + 1_000_003 * choice) % 2**63)
    return g


def _apply_penalties(logits: torch.Tensor, rows: Sequence[SampleRow]) -> None:
    """In place. Repetition (prompt + output, CTRL-style), presence and frequency (output)."""
    vocab = logits.shape[-1]
    for i, row in enumerate(rows):
        p = row.params
        if p.repetition_penalty != 1.0:
            seen = torch.tensor(row.token_ids, dtype=torch.long, device=logits.device)
            seen = seen[seen < vocab].unique()
            vals = logits[i, seen]
            logits[i, seen] = torch.where(vals > 0, vals / p.repetition_penalty, vals * p.repetition_penalty)
        if (p.presence_penalty or p.frequency_penalty) and row.output_ids:
            out = torch.tensor(list(row.output_ids), dtype=torch.long, device=logits.device)
            counts = torch.bincount(out[out < vocab], minlength=vocab).to(logits.dtype)
            logits[i] -= p.frequency_penalty * counts + p.presence_penalty * (counts > 0).to(logits.dtype)


def _filter(logits: torch.Tensor, rows: Sequence[SampleRow]) -> torch.Tensor:
    """Mask tokens outside top-k / top-p / min-p with -inf (rows already temperature-scaled)."""
    dev = logits.device
    vocab = logits.shape[-1]
    # the engine rejects top_k > vocab; clamped anyway, as a long tensor cannot hold any int
    top_k = torch.tensor([min(r.params.top_k, vocab) for r in rows], device=dev)
    top_p = torch.tensor([r.params.top_p for r in rows], dtype=logits.dtype, device=dev)
    min_p = torch.tensor([r.params.min_p for r in rows], dtype=logits.dtype, device=dev)
    if bool((top_k > 0).any()) or bool((top_p < 1).any()):
        sorted_logits, order = logits.sort(dim=-1, descending=True)
        ranks = torch.arange(vocab, device=dev).expand_as(sorted_logits)
        k = torch.where(top_k > 0, top_k, vocab).unsqueeze(1)
        drop = ranks >= k
        probs = sorted_logits.masked_fill(drop, float("-inf")).softmax(dim=-1)
        # keep the smallest set whose mass reaches top_p (always at least the best token)
        mass_before = probs.cumsum(dim=-1) - probs
        drop |= mass_before >= top_p.unsqueeze(1)
        drop[:, 0] = False
        logits = logits.scatter(1, order, sorted_logits.masked_fill(drop, float("-inf")))
    if bool((min_p > 0).any()):
        probs = logits.softmax(dim=-1)
        threshold = min_p.unsqueeze(1) * probs.max(dim=-1, keepdim=True).values
        logits = logits.masked_fill(probs < threshold, float("-inf"))
    return logits


def sample(logits: torch.Tensor, rows: Sequence[SampleRow],
           token_bitmask: torch.Tensor | None = None) -> SampleResult:
    """Pick one token per row. ``logits``: [B, V] float32 (consumed).

    ``token_bitmask``: ``[B, ceil(V / 32)]`` int32, the allowed tokens of constrained rows (all
    ones for free rows; kernels/token_bitmask.py has the layout). Logprobs stay those of the
    model's raw distribution; the choice is made among the allowed tokens only.
    """
    assert logits.dim() == 2 and logits.shape[0] == len(rows), (logits.shape, len(rows))
    logits = logits.float()
    want_logprobs = any(r.params.logprobs for r in rows)
    raw_logprobs = logits.log_softmax(dim=-1) if want_logprobs else None
    dead_ends = None
    if token_bitmask is not None:
        logits = logits.contiguous()  # consumed: masked in place (raw_logprobs is its own tensor)
        apply_token_bitmask(logits, token_bitmask)
    if any(r.params.repetition_penalty != 1.0 or r.params.presence_penalty or r.params.frequency_penalty
           for r in rows):
        logits = logits.clone()
        _apply_penalties(logits, rows)

    dev = logits.device
    is_greedy = [r.params.temperature == 0 for r in rows]
    chosen = logits.argmax(dim=-1)
    if not all(is_greedy):
        greedy = torch.tensor(is_greedy, device=dev)
        temps = torch.tensor([r.params.temperature or 1.0 for r in rows], dtype=logits.dtype, device=dev)
        scaled = _filter(logits / temps.unsqueeze(1), rows)
        probs = scaled.softmax(dim=-1)
        # Exponential-race sampling: argmax(p / E), E ~ Exp(1), equals a categorical draw and
        # batches; seeded rows draw their noise from their own generator.
        noise = torch.empty_like(probs).exponential_()
        for i, row in enumerate(rows):
            if row.generator is not None and not is_greedy[i]:
                noise[i] = torch.empty(probs.shape[1]).exponential_(generator=row.generator).to(dev)
        sampled = (probs / noise).argmax(dim=-1)
        chosen = torch.where(greedy, chosen, sampled)

    if token_bitmask is not None:
        # a row whose grammar allows nothing picks a -inf token (argmax of all -inf, or of the
        # NaNs their softmax gives): one gathered value per row finds it, not a second pass
        dead = logits.gather(1, chosen.unsqueeze(1)).squeeze(1) == float("-inf")
        dead_ends = dead.tolist() if bool(dead.any()) else None
    token_ids = chosen.tolist()
    if raw_logprobs is None:
        return SampleResult(token_ids, None, None, None, dead_ends)
    chosen_lp = raw_logprobs.gather(1, chosen.unsqueeze(1)).squeeze(1).tolist()
    k = max(r.params.top_logprobs for r in rows)
    if k > 0:
        top_vals, top_idx = raw_logprobs.topk(k, dim=-1)
        return SampleResult(token_ids, chosen_lp, top_idx.tolist(), top_vals.tolist(), dead_ends)
    return SampleResult(token_ids, chosen_lp, [[] for _ in rows], [[] for _ in rows], dead_ends)
