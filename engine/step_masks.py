"""The grammar masks of a step's constrained rows.

A plain row's mask depends only on its matcher's state, which is final once the step is
scheduled, so the masks are filled on the masker's thread while the forward runs; a draft
verify row needs one mask per draft position (``draft_bitmask``), made after the forward.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from concurrent.futures import Future
from typing import Any

import torch

from prefixgate.engine.grammar import TokenMasker


class StepMasks:
    """The bitmask rows of a step's constrained plain rows, filled during the forward.

    Args:
        chunks: the step's scheduled chunks.
        masker: builds (on first use) the engine's TokenMasker; called only when a row is
            constrained.
    """

    __slots__ = ("_pending", "bitmask", "row_of")

    def __init__(self, chunks: Sequence[Any], masker: Callable[[], TokenMasker]) -> None:
        # a verify chunk's masks, one per draft position, are made with its drafts instead
        constrained = [c.seq for c in chunks
                       if c.need_logits and c.seq.state.matcher is not None and not c.draft_ids]
        self.row_of = {seq.seq_id: i for i, seq in enumerate(constrained)}  # seq_id -> bitmask row
        self._pending: Future[torch.Tensor] | None = (
            masker().start([s.state.matcher for s in constrained]) if constrained else None)
        self.bitmask: torch.Tensor | None = None  # [constrained rows, words] once waited for

    def wait(self) -> None:
        """Wait for the fill (call it even when the forward failed: the thread is shared)."""
        if self._pending is not None:
            self.bitmask = self._pending.result()

    def for_rows(self, row_masks: list[int], device: torch.device) -> torch.Tensor | None:
        """One bitmask row per sampled row (``row_masks``: each row's, -1 = free); None when
        no sampled row is constrained."""
        if self.bitmask is None or all(m < 0 for m in row_masks):
            return None
        return row_bitmask(self.bitmask, row_masks, device)


def row_bitmask(bitmask: torch.Tensor, row_masks: list[int], device: torch.device) -> torch.Tensor:
    """One bitmask row per sampled row: its grammar's, or all ones (-1) for a free row."""
    if row_masks == list(range(bitmask.shape[0])):  # every row constrained, in fill order
        return bitmask.to(device)
    full = torch.full((len(row_masks), bitmask.shape[1]), -1, dtype=torch.int32)
    taken = [i for i, m in enumerate(row_masks) if m >= 0]
    full[taken] = bitmask[[row_masks[i] for i in taken]]
    return full.to(device)
