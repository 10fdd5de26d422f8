"""Batched sampling in torch: penalties, temperature, top-k / top-p / min-p, seeds, logprobs,
and the verification of speculative draft tokens against that same sampling.

One row per sequence that needs a token this step. Rows with temperature 0 are greedy. A
per-request ``seed`` gives the row its own torch.Generator (created once per sequence), so the
same request with the same seed reproduces its output whatever else is in the batch.

``target_distribution`` is the one place a row's logits become what it is sampled from (grammar
mask, penalties, temperature, filters); ``sample`` draws one token per row from it and
``verify`` checks draft tokens position by position against it.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from prefixgate.engine.api import SamplingParams
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


@dataclass(frozen=True, slots=True)
class Target:
    """What each row is sampled from (``target_distribution``)."""

    logits: torch.Tensor  # [B, V] after the grammar mask and penalties: a greedy row's argmax
    # [B, V] after temperature, top-k, top-p and min-p (a greedy row's is unused); None when
    # every row is greedy
    probs: torch.Tensor | None
    greedy: list[bool]


@dataclass(frozen=True, slots=True)
class Verified:
    """One sequence's verified drafts: the accepted ones, then the token that follows them (the
    replacement of the first rejected draft, or the bonus token after a fully accepted one)."""

    token_ids: list[int]  # num_accepted drafts + 1 token
    num_accepted: int
    logprobs: list[float] | None  # per emitted token (raw model distribution), as in SampleResult
    top_ids: list[list[int]] | None
    top_logprobs: list[list[float]] | None
    # the token after the drafts has no allowed choice: its grammar masked every token there
    dead_end: bool = False


def make_generator(seed: int | None, choice: int) -> torch.Generator | None:
    if seed is None:
        return None
    g = torch.Generator(device="cpu")
    g.manual_seed((seed + 1_000_003 * choice) % 2**63)
    return g


def has_penalties(params: SamplingParams) -> bool:
    return params.repetition_penalty != 1.0 or bool(params.presence_penalty) or bool(params.frequency_penalty)


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


def target_distribution(logits: torch.Tensor, rows: Sequence[SampleRow],
                        token_bitmask: torch.Tensor | None = None) -> Target:
    """Each row's distribution exactly as the sampler draws from it. ``logits``: [B, V] float32
    (consumed: a ``token_bitmask`` masks it in place)."""
    if token_bitmask is not None:
        logits = logits.contiguous()
        apply_token_bitmask(logits, token_bitmask)
    if any(has_penalties(r.params) for r in rows):
        logits = logits.clone()
        _apply_penalties(logits, rows)
    greedy = [r.params.temperature == 0 for r in rows]
    probs = None
    if not all(greedy):
        temps = torch.tensor([r.params.temperature or 1.0 for r in rows], dtype=logits.dtype,
                             device=logits.device)
        probs = _filter(logits / temps.unsqueeze(1), rows).softmax(dim=-1)
    return Target(logits, probs, greedy)


def _race_noise(generator: torch.Generator, vocab: int, device: torch.device) -> torch.Tensor:
    """A seeded row's Exp(1) noise for one token: one [V] draw from its own generator, so the
    token at each output position uses the same draw batched, alone, or under verification."""
    return torch.empty(vocab).exponential_(generator=generator).to(device)


def _logprob_fields(raw_logprobs: torch.Tensor, chosen: torch.Tensor, rows: Sequence[SampleRow]
                    ) -> tuple[list[float], list[list[int]], list[list[float]]]:
    """The chosen tokens' raw logprobs and each row's top ``max(top_logprobs)``."""
    chosen_lp = raw_logprobs.gather(1, chosen.unsqueeze(1)).squeeze(1).tolist()
    k = max(r.params.top_logprobs for r in rows)
    if k > 0:
        top_vals, top_idx = raw_logprobs.topk(k, dim=-1)
        return chosen_lp, top_idx.tolist(), top_vals.tolist()
    return chosen_lp, [[] for _ in rows], [[] for _ in rows]


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
    target = target_distribution(logits, rows, token_bitmask)
    chosen = target.logits.argmax(dim=-1)
    if target.probs is not None:
        probs = target.probs
        dev = probs.device
        # Exponential-race sampling: argmax(p / E), E ~ Exp(1), equals a categorical draw and
        # batches; seeded rows draw their noise from their own generator.
        noise = torch.empty_like(probs).exponential_()
        for i, row in enumerate(rows):
            if row.generator is not None and not target.greedy[i]:
                noise[i] = _race_noise(row.generator, probs.shape[1], dev)
        sampled = (probs / noise).argmax(dim=-1)
        chosen = torch.where(torch.tensor(target.greedy, device=dev), chosen, sampled)

    if token_bitmask is not None:
        # a row whose grammar allows nothing picks a -inf token (argmax of all -inf, or of the
        # NaNs their softmax gives): one gathered value per row finds it, not a second pass
        dead = target.logits.gather(1, chosen.unsqueeze(1)).squeeze(1) == float("-inf")
        dead_ends = dead.tolist() if bool(dead.any()) else None
    token_ids = chosen.tolist()
    if raw_logprobs is None:
        return SampleResult(token_ids, None, None, None, dead_ends)
    return SampleResult(token_ids, *_logprob_fields(raw_logprobs, chosen, rows), dead_ends)


def verify(logits: torch.Tensor, rows: Sequence[SampleRow], drafts: Sequence[Sequence[int]],
           token_bitmask: torch.Tensor | None = None) -> list[Verified]:
    """Verify draft tokens against the sampler's own distributions: per sequence, the accepted
    drafts and the token after them, distributed exactly as decoding one token at a time.

    Args:
        logits: ``[sum(len(d) + 1 for d in drafts), V]`` float32: per sequence in order, the
            rows of its verify chunk (row ``i`` predicts the token after draft ``i - 1``; the
            last row follows the last draft).
        rows: one per logits row. A sequence's rows share its params and generator; row ``i``'s
            ``token_ids`` must include drafts ``0..i-1`` when the request has penalties.
        drafts: each sequence's draft tokens (at least one each).
        token_bitmask: one row per logits row (as in :func:`sample`): a constrained
            sequence's row ``i`` allows what its grammar allows after drafts ``0..i-1``.

    Returns:
        One Verified per sequence.

    NOTE: rejection sampling for a drafter whose proposal is a point mass on the draft ``x``
    (q = δ_x): position by position, accept ``x`` with probability min(1, p(x) / q(x)) = p(x)
    (p: the row's target_distribution); at the first rejection draw the replacement from the
    residual max(0, p - q) ∝ p without ``x`` and stop; after all k drafts draw the bonus token
    from p_{k+1}. Greedy rows are the limit: accept while ``x`` is the argmax, then the argmax.
    Unseeded rows do exactly that (one uniform per position, one vocabulary-sized draw per
    sequence). Seeded rows realise the same law by coupling: at each position draw ``y ~ p``
    exactly as ``sample`` would (one exponential race from the request's generator) and accept
    iff ``y == x`` (probability p(x); given a rejection, ``y`` is p restricted to tokens other
    than ``x``: the residual), emitting the first rejected ``y`` (or the ``y`` after the last
    draft). So each emitted token consumes the one draw a plain decode of its position would
    take, and a seeded request's output does not depend on whether, or how much, it drafted
    (on batch composition, the speculative_max_rows cap, free pages).
    """
    num_rows = sum(len(d) + 1 for d in drafts)
    assert logits.dim() == 2 and logits.shape[0] == len(rows) == num_rows, (logits.shape, len(rows), num_rows)
    assert all(drafts), "a sequence without drafts is sampled, not verified"
    logits = logits.float()
    raw_logprobs = logits.log_softmax(dim=-1) if any(r.params.logprobs for r in rows) else None
    target = target_distribution(logits, rows, token_bitmask)
    greedy_ids = target.logits.argmax(dim=-1).tolist()
    starts = [0]
    for d in drafts:
        starts.append(starts[-1] + len(d) + 1)
    accept = _plain_acceptances(target, rows, drafts, starts)
    results: list[tuple[list[int], int, int]] = []  # (emitted tokens, accepted, first row)
    for j, draft in enumerate(drafts):
        at = starts[j]
        tokens, n = _verify_sequence(draft, at, rows[at], target, greedy_ids, accept)
        results.append((tokens, n, at))
    dead = [False] * len(results)
    if token_bitmask is not None:  # accepted drafts are allowed; the token after them may not be
        last = torch.tensor([at + n for _, n, at in results], device=logits.device)
        chosen = torch.tensor([tokens[-1] for tokens, _, _ in results], device=logits.device)
        dead = (target.logits[last, chosen] == float("-inf")).tolist()
    if raw_logprobs is None:
        return [Verified(tokens, n, None, None, None, d)
                for (tokens, n, _), d in zip(results, dead, strict=True)]
    return _with_logprobs(results, dead, raw_logprobs, rows)


def _plain_acceptances(target: Target, rows: Sequence[SampleRow], drafts: Sequence[Sequence[int]],
                       starts: list[int]) -> dict[int, bool]:
    """Unseeded sampled sequences: whether each draft position is accepted (logits row ->
    accepted), one uniform per position drawn for all of them at once."""
    plain = [j for j in range(len(drafts))
             if rows[starts[j]].generator is None and not target.greedy[starts[j]]]
    if not plain:
        return {}
    probs = target.probs
    assert probs is not None
    at_rows = [starts[j] + n for j in plain for n in range(len(drafts[j]))]
    at_tokens = [t for j in plain for t in drafts[j]]
    # accepted where u < p(x) / sum(p): the sum (1 up to rounding) makes a draft holding
    # all the mass always accepted, so a rejection never meets an empty residual
    p_of = probs[at_rows, at_tokens]
    keep = torch.rand(len(at_rows), device=probs.device) * probs[at_rows].sum(dim=-1) < p_of
    return dict(zip(at_rows, keep.tolist(), strict=True))


def _verify_sequence(draft: Sequence[int], at: int, row: SampleRow, target: Target,
                     greedy_ids: list[int], accept: dict[int, bool]) -> tuple[list[int], int]:
    """One sequence's drafts (its logits rows from ``at``): (emitted tokens, drafts accepted)."""
    probs = target.probs
    n = 0
    if target.greedy[at]:
        while n < len(draft) and greedy_ids[at + n] == draft[n]:
            n += 1
        return [*draft[:n], greedy_ids[at + n]], n
    assert probs is not None
    vocab = probs.shape[1]
    if row.generator is None:
        while n < len(draft) and accept[at + n]:
            n += 1
        weights = probs[at + n]
        if n < len(draft):  # the residual: p without the rejected draft (the race is scale-free)
            weights = weights.clone()
            weights[draft[n]] = 0.0
        token = int((weights / torch.empty(vocab, device=weights.device).exponential_()).argmax())
        return [*draft[:n], token], n
    while True:  # drawn only while the drafts hold: one draw per emitted token
        token = int((probs[at + n] / _race_noise(row.generator, vocab, probs.device)).argmax())
        if n == len(draft) or token != draft[n]:
            return [*draft[:n], token], n
        n += 1


def _with_logprobs(results: list[tuple[list[int], int, int]], dead: list[bool],
                   raw_logprobs: torch.Tensor, rows: Sequence[SampleRow]) -> list[Verified]:
    """The Verified records with each emitted token's logprob and top alternatives, read at
    the logits row that predicted it."""
    positions = [first + j for tokens, _, first in results for j in range(len(tokens))]
    emitted = torch.tensor([t for tokens, _, _ in results for t in tokens], device=raw_logprobs.device)
    lps, top_ids, top_lps = _logprob_fields(raw_logprobs[positions], emitted, [rows[p] for p in positions])
    out, start = [], 0
    for (tokens, n, _), d in zip(results, dead, strict=True):
        end = start + len(tokens)
        out.append(Verified(tokens, n, lps[start:end], top_ids[start:end], top_lps[start:end], d))
        start = end
    return out
