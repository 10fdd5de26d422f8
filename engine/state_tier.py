"""The second tier of a hybrid model's state checkpoints: host memory beside the KV tier.

A checkpoint evicted from the runner's state slots (cache/state_slots.py) is copied here at
once, while its slot still holds it (eviction happens while the step is scheduled, before the
forward writes anything), keyed by its block's chained hash. A later prefix hit that finds the
pages (in the pool or the KV tier) but not the checkpoint in the slots reinstalls it into a slot
and restores from it, instead of recomputing from an earlier checkpoint. Bounded by a number of
checkpoints, least recently used out first.

NOTE: the entries are this process's own host memory, as trusted as the state slots
themselves: the key names the tokens (and tenant salt) the state was computed over, so an
entry is used only by a prefix with the same tokens; no checksum is kept (the KV tier's
verification exists for stores outside the process).
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Any

import torch


class StateTier:
    """Host copies of evicted state checkpoints.

    Args:
        states: the runner's state pools (``RecurrentState`` per linear layer).
        capacity: checkpoints kept at most.
    """

    def __init__(self, states: list[Any], capacity: int) -> None:
        if capacity < 1:
            raise ValueError(f"state tier capacity must be >= 1, got {capacity}")
        self.states = states
        self.capacity = capacity
        self._entries: OrderedDict[bytes, list[torch.Tensor]] = OrderedDict()
        self.num_spilled = 0
        self.num_loaded = 0

    def __contains__(self, block_hash: bytes) -> bool:
        return block_hash in self._entries

    def __len__(self) -> int:
        return len(self._entries)

    @torch.inference_mode()
    def spill(self, block_hash: bytes, slot: int) -> None:
        """Copy slot ``slot`` (a checkpoint being evicted) out under ``block_hash``."""
        self._entries[block_hash] = [t[slot].to("cpu", copy=True)
                                     for pool in self.states for t in (pool.conv, pool.matrix)]
        self._entries.move_to_end(block_hash)
        self.num_spilled += 1
        while len(self._entries) > self.capacity:
            self._entries.popitem(last=False)

    def take(self, block_hash: bytes) -> list[torch.Tensor]:
        """Remove and return the copy of ``block_hash`` (it goes back into a slot)."""
        return self._entries.pop(block_hash)

    @torch.inference_mode()
    def write(self, entry: list[torch.Tensor], slot: int) -> None:
        """Write a copy :meth:`take` returned into slot ``slot``."""
        tensors = iter(entry)
        for pool in self.states:
            for target in (pool.conv, pool.matrix):
                target[slot] = next(tensors).to(target.device)
        self.num_loaded += 1

    def clear(self) -> None:
        self._entries.clear()


__all__ = ["StateTier"]
