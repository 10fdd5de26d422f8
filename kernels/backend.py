"""What a kernel backend is: an object chosen once at start-up (kernels/dispatch.py), bound
to the KV pool, that prepares each step's attention metadata once for every layer.

    backend = create_backend(name, kv_pool, ...)           # runner start-up
    step = backend.prepare_metadata(inputs)                # once per step (the runner)
    out = step.forward(q, k, v, k_cache, v_cache, scale)   # every layer (the model)
    out = step.forward(..., scale, window=w)               # a sliding-window layer
    backend.copy_pages(src, dst)                           # copy-on-write, before the forward

``forward`` writes the step's K/V into the layer's pages, then attends over them; it
validates the layout on the step's first call only (every layer's caches are views of one pool,
and every layer's q/k/v come out of the same projections). ``window`` makes it a sliding layer
(Gemma 3's local layers): each row sees only the last ``window`` positions, itself included;
the pages still hold every token, so prefix hits and copy-on-write work as for full layers.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple, Protocol

import torch


class AttentionInputs(NamedTuple):
    """One step's attention addressing, as host lists (for planning) and device tensors.

    Layout of the tensors: see kernels/layout.py.
    """

    block_tables: Sequence[Sequence[int]]  # per sequence, its used page ids (host)
    seq_lens: Sequence[int]  # per sequence, context length after this step (host)
    query_start_loc: Sequence[int]  # S + 1 row offsets (host)
    max_query_len: int  # the largest n_s (1 = pure decode step)
    slot_mapping: torch.Tensor  # [T] int64, page_id * page_size + offset, -1 = skip
    block_tables_tensor: torch.Tensor  # [S, max_pages] int32
    seq_lens_tensor: torch.Tensor  # [S] int32
    query_start_loc_tensor: torch.Tensor  # [S + 1] int32


class StepAttention(Protocol):
    """One step's attention, bound to its backend and addressing; every layer calls it."""

    def forward(
        self,
        query: torch.Tensor,  # [T, Hq, D]
        key: torch.Tensor,  # [T, Hkv, D]
        value: torch.Tensor,  # [T, Hkv, D]
        k_cache: torch.Tensor,  # [num_pages, page_size, Hkv, D]
        v_cache: torch.Tensor,  # [num_pages, page_size, Hkv, D]
        scale: float,
        window: int | None = None,
    ) -> torch.Tensor:  # [T, Hq, D]
        """Write ``key``/``value`` into their slots, then attend ``query`` over the pages
        (over the last ``window`` positions of each row only, when given)."""
        ...


class AttentionBackend(Protocol):
    """A kernel backend bound to one KV pool ``[L, 2, num_pages, page_size, Hkv, D]``."""

    name: str

    def prepare_metadata(self, inputs: AttentionInputs) -> StepAttention:
        """Everything a step's layers share, worked out once (plans, validation)."""
        ...

    def copy_pages(self, src: torch.Tensor, dst: torch.Tensor) -> None:
        """Copy-on-write: ``kv_pool[:, :, dst[i]] = kv_pool[:, :, src[i]]`` (int64 ids)."""
        ...
