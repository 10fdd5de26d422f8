"""Fault isolation (invariant 7): a failure of one request fails that request alone.

Two places of a step can fail for one row's sake: the forward (a chunk the model cannot run)
and the per-row work after it (sampling, draft verification). Both first run the whole batch
at once (the fast path), and only when that raises find the rows that fail alone:

* :func:`execute_isolated` bisects the forward's chunks;
* :func:`per_row` reruns a batched call row by row.

Either raises when nothing runs at all (the model, the device or the sampler itself is broken):
that is not a per-request failure, and the caller fails everything and recovers.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

import torch

from prefixgate.engine.api import EngineError

logger = logging.getLogger("prefixgate.engine")

R = TypeVar("R")


def isolated_failure(cause: str) -> EngineError:
    """The error of a request that failed alone in a step (``cause``: what failed)."""
    return EngineError(
        f"{cause}; it was stopped (other requests in the step were not affected)",
        code="request_failed")


def grammar_dead_end() -> EngineError:
    """The error of a constrained request whose grammar allows no next token."""
    return EngineError("the output grammar allows no next token (a dead end); the request was "
                       "stopped", code="grammar_dead_end")


def per_row(batched: Callable[[], list[R]], one: Callable[[int], R], num_rows: int, what: str,
            *, describe: Callable[[int], object] = str,
            before_retry: Callable[[], None] | None = None) -> list[R | None]:
    """``batched()``; if it raises, ``one(i)`` for each row alone (None where that raises).

    Args:
        batched: the whole batch at once; one result per row.
        one: row ``i`` alone; the same result it has in the batch (each row's filters,
            penalties and seeded generator are its own).
        num_rows: how many rows there are.
        what: names the work in the log ("sampling", "verification").
        describe: row ``i`` as the log shows it (its parameters).
        before_retry: undoes what the failed batched call consumed (rewinds generators).

    Returns:
        One result per row; None for a row that failed alone (its request fails alone).

    Raises:
        RuntimeError: every row of a batch of several fails alone: not a per-request failure.
    """
    try:
        return batched()
    except Exception:
        logger.exception("batched %s of %d rows failed; row by row", what, num_rows)
    if before_retry is not None:
        before_retry()
    out: list[R | None] = []
    for i in range(num_rows):
        try:
            out.append(one(i))
        except Exception:
            logger.exception("%s failed for one row (%s)", what, describe(i))
            out.append(None)
    if num_rows > 1 and all(r is None for r in out):
        raise RuntimeError(f"the {what} fails on every row: not a per-request failure")
    return out


def _num_logits(chunk: Any) -> int:
    return getattr(chunk, "num_logits", 1)  # > 1: a draft verify chunk


class _Bisection:
    """The state of one forward's culprit search (see :func:`execute_isolated`)."""

    def __init__(self, execute: Callable[..., torch.Tensor], chunks: Sequence[Any],
                 copy_pairs: Sequence[tuple[int, int]], first_error: Exception) -> None:
        self.execute, self.chunks, self.copy_pairs = execute, chunks, copy_pairs
        self.first_error = first_error
        self.owner = {page: i for i, c in enumerate(chunks) for page in c.block_table}
        self.rows: dict[int, torch.Tensor] = {}
        self.culprits: list[int] = []
        self.num_ok, self.num_failed = 0, 1
        # a dead model fails every run: give up once a bisection path fails with no success
        self.limit = 2 * len(chunks).bit_length() + 2

    def run(self, indexes: list[int]) -> None:
        try:
            picked = set(indexes)
            logits = self.execute([self.chunks[i] for i in indexes],
                                  [p for p in self.copy_pairs if self.owner.get(p[1]) in picked])
        except Exception:
            self.num_failed += 1
            if len(indexes) == 1:
                self.culprits.append(indexes[0])
                return
            if not self.num_ok and self.num_failed > self.limit:
                raise self.first_error from None
            half = len(indexes) // 2
            self.run(indexes[:half])
            self.run(indexes[half:])
            return
        self.num_ok += 1
        at = 0
        for i in indexes:
            if self.chunks[i].need_logits:
                count = _num_logits(self.chunks[i])
                self.rows[i] = logits[at : at + count]
                at += count

    def logits(self, vocab_size: int) -> torch.Tensor:
        """Every sampling chunk's rows in order; zero rows for a culprit's."""
        like = next(iter(self.rows.values()), None)
        if like is None:
            return torch.empty((0, vocab_size))
        return torch.cat([
            self.rows[i] if i in self.rows else like.new_zeros((_num_logits(c), like.shape[1]))
            for i, c in enumerate(self.chunks) if c.need_logits])


def execute_isolated(execute: Callable[..., torch.Tensor], chunks: Sequence[Any],
                     copy_pairs: Sequence[tuple[int, int]], vocab_size: int
                     ) -> tuple[torch.Tensor, list[int]]:
    """Run the forward; if it raises, find the chunks that fail it alone (bisection).

    Args:
        execute: the runner's ``execute(chunks, copy_pairs) -> logits``.
        chunks / copy_pairs: the step's.
        vocab_size: the logits' width (for a step where no chunk ran).

    Returns:
        The logits of every chunk with ``need_logits`` (in order; zero rows for a culprit) and
        the indexes of the culprit chunks, whose requests the caller fails.

    Raises:
        The forward's exception when no part of the step can run (the model or device itself
        failed): the caller fails everything and recovers.

    NOTE: a re-run is safe because each chunk writes only its own pages: a copy-on-write pair
    is re-run with the chunk that owns its destination page, restoring the shared part before
    the chunk rewrites the same K/V. Matchers are not touched here (they advance only after
    sampling), so nothing is advanced twice.
    """
    try:
        return execute(chunks, list(copy_pairs)), []
    except Exception as exc:
        logger.exception("the forward of a %d-chunk step failed; isolating the culprit", len(chunks))
        if len(chunks) == 1:
            raise
        search = _Bisection(execute, chunks, copy_pairs, exc)
    half = len(chunks) // 2
    search.run(list(range(half)))
    search.run(list(range(half, len(chunks))))
    if not search.num_ok:
        raise search.first_error
    return search.logits(vocab_size), search.culprits
