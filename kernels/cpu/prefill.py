"""Native CPU prefill attention (kernels/cpu/csrc/paged_prefill.c): one sequence's new query rows
attend causally to its context, K/V read in place from the pages.

Why: the torch path gathers the context into a dense buffer and runs SDPA's CPU flash kernel,
whose GEMM blocks are thin at small head dims (64 here: docs/benchmarks.md); the C kernel
tiles the G query heads of a KV head together and scores 16
keys per vector. Same switch, fallbacks and page dtypes (fp32 or bf16, widened exactly on
load) as the native decode kernel (kernels/cpu/decode.py).
"""

from __future__ import annotations

import torch

from prefixgate.kernels.cpu.attention_inputs import (
    heads_inconsistent,
    partly_overlaps,
    takes_dtypes,
    window_arg,
)
from prefixgate.kernels.cpu.decode import sinks_accepted
from prefixgate.kernels.cpu.library import library


def paged_prefill_native(
    out: torch.Tensor,  # [n, Hq, D] fp32
    query: torch.Tensor,  # [n, Hq, D] fp32 (rows at any stride, heads dense)
    k_cache: torch.Tensor,  # [num_pages, page_size, Hkv, D] fp32 or bf16, contiguous
    v_cache: torch.Tensor,
    pages: torch.Tensor,  # [>= ceil(ctx_len / page_size)] int64, the sequence's pages in order
    ctx_len: int,
    scale: float,
    num_threads: int | None = None,
    window: int | None = None,
    sinks: torch.Tensor | None = None,  # [Hq] fp32 attention-sink logits (gpt-oss)
) -> bool:
    """Causal attention of ``n`` new rows, row ``i`` at position ``ctx_len - n + i``;
    ``window``: a sliding layer, row ``i`` sees only its last ``window`` positions (the pages
    before the first row's window are not read).

    Returns False (touching nothing) when the kernel is unavailable or the inputs are not what
    it handles (query/out not fp32, caches neither fp32 nor bf16, non-CPU, non-contiguous
    caches, overlapping output rows or an output that partly overlaps the query, head dim not
    a multiple of 16 or above its limit, GQA group above its limit); the caller then runs the
    torch path.

    Raises:
        ValueError: inconsistent shapes, ``ctx_len < n``, too few pages, a page id outside
            the pool or a window < 1 (checked before anything is read or written).
    """
    window = window_arg(window, "paged prefill")
    lib = library()
    if lib is None or not takes_dtypes(out, query, k_cache, v_cache, pages):
        return False
    if heads_inconsistent(out, query, k_cache, v_cache) or pages.dim() != 1:
        raise ValueError(
            f"paged prefill: inconsistent shapes: query/out {tuple(query.shape)}/"
            f"{tuple(out.shape)}, k/v cache {tuple(k_cache.shape)}/{tuple(v_cache.shape)}, "
            f"pages {tuple(pages.shape)}"
        )
    n_rows, num_q_heads, head_dim = query.shape
    page_size, num_kv_heads = k_cache.shape[1], k_cache.shape[2]
    if not n_rows <= ctx_len < 2**31:
        raise ValueError(f"paged prefill: context {ctx_len} shorter than its {n_rows} new rows")
    if pages.shape[0] * page_size < ctx_len:
        raise ValueError(f"paged prefill: {pages.shape[0]} pages of {page_size} cannot hold {ctx_len} tokens")
    if _declines(lib, out, query, k_cache, v_cache, pages) or not sinks_accepted(sinks, query):
        return False
    if n_rows == 0:
        return True
    rc = lib.pg_paged_prefill_f32(
        query.data_ptr(), query.stride(0), k_cache.data_ptr(), v_cache.data_ptr(),
        pages.data_ptr(), pages.shape[0], ctx_len, n_rows, out.data_ptr(), out.stride(0),
        num_q_heads, num_kv_heads, head_dim, page_size, scale,
        num_threads or torch.get_num_threads(), k_cache.shape[0],
        int(k_cache.dtype == torch.bfloat16), window,
        sinks.data_ptr() if sinks is not None else None,
    )
    if rc == -2:  # the sizes were checked above: a page id is out of range
        raise ValueError(f"paged prefill: a page id outside the pool [0, {k_cache.shape[0]})")
    if rc != 0:
        raise MemoryError("native prefill kernel could not allocate its scratch")
    return True


def _declines(
    lib, out: torch.Tensor, query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
    pages: torch.Tensor,
) -> bool:
    """Whether the kernel leaves these (consistent) inputs to the torch path."""
    n_rows, num_q_heads, head_dim = query.shape
    return bool(
        partly_overlaps(out, query)
        or (n_rows > 1 and out.stride(0) < num_q_heads * head_dim)
        or head_dim % 16
        or head_dim > lib.prefill_max_head_dim
        or num_q_heads // k_cache.shape[2] > lib.prefill_max_group
        or not (k_cache.is_contiguous() and v_cache.is_contiguous())
        or query.stride(2) != 1
        or query.stride(1) != head_dim
        or out.stride(2) != 1
        or out.stride(1) != head_dim
        or not pages.is_contiguous()
        or pages.dtype != torch.int64
        or pages.device.type != "cpu"
    )


__all__ = ["paged_prefill_native"]
