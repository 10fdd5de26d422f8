"""Paged attention on the Triton backend: split-K decode kernel + prefix-prefill kernel.

A flat batch mixes decode sequences (n_s == 1) and prefill chunks (n_s > 1). Both kernels are
launched over ALL sequences and each skips the sequences of the other kind on the device, so
the split never needs the host to read ``query_start_loc`` (no GPU sync). When the caller
knows the batch is decode-only (``max_query_len == 1``) the prefill launch is skipped.
"""

from __future__ import annotations

import torch

from prefixgate.kernels.checks import check_attention_inputs, require
from prefixgate.kernels.triton.common import check_triton_device
from prefixgate.kernels.triton.decode import paged_decode_triton
from prefixgate.kernels.triton.prefill import paged_prefill_triton


def paged_attention_triton(
    query: torch.Tensor,  # [T, Hq, D]
    k_cache: torch.Tensor,  # [num_pages, page_size, Hkv, D]
    v_cache: torch.Tensor,  # [num_pages, page_size, Hkv, D]
    block_tables: torch.Tensor,  # [S, max_pages] int32
    seq_lens: torch.Tensor,  # [S] int32, context length after this step
    query_start_loc: torch.Tensor,  # [S + 1] int32
    scale: float,
    *,
    max_query_len: int | None = None,
    pages_per_split: int | None = None,
    window: int | None = None,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:  # [T, Hq, D]
    """Causal attention of each sequence's new query rows over its paged context (Triton).

    Args:
        max_query_len: the largest n_s in the batch when the caller knows it (the runner
            does); ``1`` skips the prefill launch. ``None`` launches both kernels.
        pages_per_split: force the split-K size of decode (tests); ``None`` picks it from
            the batch shape and the device's SM count.
        window: a sliding layer: each row sees only the last ``window`` positions, itself
            included (None: the whole context).
        sinks: ``[Hq]`` fp32 attention-sink logits (gpt-oss): one more term in each head's
            softmax, attending nothing.
    Returns:
        ``[T, Hq, D]`` in the query's dtype. Rows of sequences with n_s == 0 do not exist.
    """
    shapes = check_attention_inputs(
        query, k_cache, v_cache, block_tables, seq_lens, query_start_loc
    )
    check_triton_device(query)
    # tl.dot tiles need >= 16 along the reduction dim on GPUs
    require(
        shapes.head_dim >= 16, f"the triton backend needs head_dim >= 16, got {shapes.head_dim}"
    )
    require(
        max_query_len is None or max_query_len >= 0,
        f"max_query_len must be >= 0, got {max_query_len}",
    )
    require(window is None or window > 0, f"window must be positive, got {window}")
    require(sinks is None or (sinks.shape == (query.shape[1],) and sinks.dtype == torch.float32
                              and sinks.is_contiguous() and sinks.device == query.device),
            f"sinks must be a contiguous float32 [{query.shape[1]}] tensor on the query's device")
    # dense rows even when query is a strided view (q sliced out of a fused qkv)
    out = torch.empty(query.shape, dtype=query.dtype, device=query.device)
    if shapes.num_tokens == 0:
        return out
    args = (query, k_cache, v_cache, block_tables, seq_lens, query_start_loc, scale, out, shapes)
    paged_decode_triton(*args, pages_per_split=pages_per_split, window=window, sinks=sinks)
    if max_query_len is None or max_query_len > 1:
        paged_prefill_triton(*args, window=window, sinks=sinks)
    return out
