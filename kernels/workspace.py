"""Reusable per-thread buffers the torch backend gathers pages into.

Why: on CPU a fresh multi-MB tensor per call is mmap'ed and page-faulted in again every time
(glibc hands big blocks straight back to the OS), which made the gather several times slower
than the copy itself. Reusing one buffer per (thread, device, dtype, K/V role) keeps it at copy speed.
Buffers only grow; they hold at most one call's gathered context.
"""

from __future__ import annotations

import threading

import torch

_local = threading.local()


def gather_pages(cache: torch.Tensor, page_ids: torch.Tensor, role: str) -> torch.Tensor:
    """``cache.index_select(0, page_ids)`` into this thread's reusable ``role`` buffer.

    Args:
        cache: ``[num_pages, page_size, Hkv, D]``.
        page_ids: ``[N]`` int64, in range.
        role: buffer name (``"k"`` / ``"v"``); a result stays valid until the next gather
            into the same role on this thread.
    Returns:
        ``[N, page_size, Hkv, D]``, a view of the buffer.
    """
    buffers: dict[tuple, torch.Tensor] = _local.__dict__.setdefault("buffers", {})
    key = (cache.device, cache.dtype, role)
    needed = page_ids.numel() * cache[0].numel()
    buf = buffers.get(key)
    if buf is None or buf.numel() < needed:
        # NOTE: always a normal tensor, even when first needed under inference_mode: an
        # inference tensor could not be written in place by a later call outside that mode.
        with torch.inference_mode(False):
            buf = torch.empty(needed, dtype=cache.dtype, device=cache.device)
        buffers[key] = buf
    out = buf[:needed].view(page_ids.numel(), *cache.shape[1:])
    torch.index_select(cache, 0, page_ids, out=out)
    return out
