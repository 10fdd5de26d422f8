"""A sliding layer's attention on the torch backend with native kernels on: the native CPU
decode and prefill kernels with their window (kernels/cpu/decode.py, kernels/cpu/prefill.py)
read only the pages each row's window reaches, in place; rows they decline take the torch
path of kernels/sliding_window.py.

Why: the torch path loops over sequences in Python and gathers each window into a dense
buffer; a Gemma 3 decode step spends most of its local layers there (docs/models.md).
"""

from __future__ import annotations

import torch

from prefixgate.kernels.attention_plan import AttentionPlan, PaddedDecode
from prefixgate.kernels.cpu.decode import paged_decode_native
from prefixgate.kernels.cpu.prefill import paged_prefill_native
from prefixgate.kernels.sliding_window import attend_window


def paged_attention_windowed_native(
    query: torch.Tensor,  # [T, Hq, D]
    k_cache: torch.Tensor,  # [num_pages, page_size, Hkv, D]
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,  # [S, max_pages] int32
    plan: AttentionPlan,
    decode: list[PaddedDecode],  # every decode row, unshared (attention_plan.unshared_decode)
    scale: float,
    window: int | None,
    sinks: torch.Tensor | None = None,  # [Hq] fp32 attention-sink logits (gpt-oss)
) -> torch.Tensor:  # [T, Hq, D]
    """Each sequence's new rows over their last ``window`` positions (None: all), as
    :func:`~prefixgate.kernels.sliding_window.paged_attention_windowed` computes them; the
    kernels take gpt-oss's ``sinks`` into each softmax (a full sink layer comes here too: its
    decode rows are not split into shared runs).

    Raises:
        ValueError: a plan that does not fit ``query``, or a window < 1.
    """
    starts, lens = plan.starts, plan.lens
    if starts[-1] > query.shape[0]:
        raise ValueError(f"attention plan for {starts[-1]} query rows does not fit "
                         f"{query.shape[0]} rows")
    if window is not None and window < 1:
        raise ValueError(f"window must be positive, got {window}")
    page_size = k_cache.shape[1]
    out = torch.empty(query.shape, dtype=query.dtype, device=query.device)
    for s in plan.prefill:
        rows = slice(starts[s], starts[s + 1])
        pages = block_tables[s, : -(-lens[s] // page_size)].long()
        if not paged_prefill_native(out[rows], query[rows], k_cache, v_cache, pages, lens[s],
                                    scale, window=window, sinks=sinks):
            out[rows] = attend_window(query[rows], k_cache, v_cache, pages, lens[s], scale,
                                      window, sinks)
    for chunk in decode:
        if paged_decode_native(out, query, k_cache, v_cache, chunk.rows, chunk.pages,
                               chunk.lengths, scale, window=window, sinks=sinks):
            continue
        for row, pages, length in zip(chunk.rows.tolist(), chunk.pages, chunk.lengths.tolist(),
                                      strict=True):
            out[row : row + 1] = attend_window(query[row : row + 1], k_cache, v_cache, pages,
                                               length, scale, window, sinks)
    return out


__all__ = ["paged_attention_windowed_native"]
