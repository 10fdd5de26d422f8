"""Native CPU cascade decode (kernels/cpu/csrc/paged_cascade.c): the shared run of a
shared-prefix decode group, attended once by all its members' rows, merged with their own pages.

Why: the torch path runs SDPA's CPU flash kernel on a strided view of the run (bf16 pages
upcast by a copy first) and then merges with ~10 small torch ops; this kernel reads the run's
pages in place, serves all B x G rows of a KV head from each K/V row it loads, splits the keys
so that 3 KV heads still keep every thread busy, and merges by log-sum-exp as it writes the
rows out. Like the other native kernels it is built by kernels/cpu/library.py and declines
(returns False) whatever it does not handle, so the caller falls back to the torch path.
"""

from __future__ import annotations

import torch

from prefixgate.kernels.cpu.attention_inputs import (
    heads_inconsistent,
    partly_overlaps,
    takes_dtypes,
)
from prefixgate.kernels.cpu.library import library


def cascade_decode_native(
    out: torch.Tensor,  # [T, Hq, D] fp32, written at ``rows``
    query: torch.Tensor,  # [T, Hq, D] fp32 (rows at any stride, heads dense)
    k_cache: torch.Tensor,  # [num_pages, page_size, Hkv, D] fp32 or bf16, contiguous
    v_cache: torch.Tensor,
    rows: torch.Tensor,  # [B] int64, the members' query (and output) rows
    shared_pages: torch.Tensor,  # [n] int64, the shared run's page ids in order
    shared_len: int,  # tokens of the run every row attends to (<= n * page_size)
    scale: float,
    own_lse: torch.Tensor | None = None,  # [B, Hq] fp32
    lse: torch.Tensor | None = None,  # [B, Hq] fp32, filled when given
    num_threads: int | None = None,
) -> bool:
    """Decode rows of B sequences over a shared run of pages, optionally merged with their own.

    ``own_lse`` None: ``out[rows]`` gets the attention over the run alone. Given: ``out[rows]``
    must already hold each row's normalised attention over its own pages (with ``own_lse``
    its log-sum-exp, as :func:`~prefixgate.kernels.cpu.decode.paged_decode_native` writes
    them), and is overwritten with the attention over run + own pages (exact log-sum-exp
    merge, in fp32). ``lse`` gets the log-sum-exp of what ``out[rows]`` ends up holding.

    Returns False (touching nothing) when the kernel is unavailable or the inputs are not what
    it handles (query/out not fp32, caches neither fp32 nor bf16, non-CPU, non-contiguous
    caches or metadata, an output that partly overlaps the query, head dim not a multiple of
    16 or above its limit, too many rows); the caller then runs the torch path.

    Raises:
        ValueError: inconsistent shapes, ``shared_len`` < 1 or beyond its pages, a page id
            outside the pool or a row outside ``query`` (checked before anything is read or
            written).
    """
    extras = [t for t in (own_lse, lse) if t is not None]
    if not takes_dtypes(out, query, k_cache, v_cache, rows, shared_pages, *extras) or any(
        t.dtype != torch.float32 for t in extras
    ):
        return False
    lib = library()
    if lib is None:
        return False
    _check_shapes(out, query, k_cache, v_cache, rows, shared_pages, shared_len, extras)
    num_rows, num_q_heads, head_dim = query.shape
    page_size, num_kv_heads = k_cache.shape[1], k_cache.shape[2]
    if _declines(lib, out, query, k_cache, v_cache, rows, shared_pages, extras):
        return False
    rc = lib.pg_cascade_decode_f32(
        query.data_ptr(), query.stride(0), k_cache.data_ptr(), v_cache.data_ptr(),
        shared_pages.data_ptr(), shared_pages.shape[0], shared_len, rows.data_ptr(),
        rows.shape[0], own_lse.data_ptr() if own_lse is not None else None,
        out.data_ptr(), out.stride(0), lse.data_ptr() if lse is not None else None,
        num_q_heads, num_kv_heads, head_dim, page_size, scale,
        num_threads or torch.get_num_threads(), k_cache.shape[0], num_rows,
        int(k_cache.dtype == torch.bfloat16),
    )
    if rc == -2:  # the sizes were checked above: a page id or a row is out of range
        raise ValueError(f"cascade decode: a page id outside the pool [0, {k_cache.shape[0]}) "
                         f"or a row outside [0, {num_rows})")
    if rc != 0:
        raise MemoryError("native cascade kernel could not allocate its scratch")
    return True


def _check_shapes(
    out: torch.Tensor, query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
    rows: torch.Tensor, shared_pages: torch.Tensor, shared_len: int, extras: list[torch.Tensor],
) -> None:
    """ValueError unless the shapes fit together and the run fits its pages."""
    batch = rows.shape[0] if rows.dim() == 1 else -1
    if (
        heads_inconsistent(out, query, k_cache, v_cache)
        or batch < 1
        or shared_pages.dim() != 1
        or any(t.shape != (batch, query.shape[1]) for t in extras)
    ):
        raise ValueError(
            f"cascade decode: inconsistent shapes: query/out {tuple(query.shape)}/"
            f"{tuple(out.shape)}, k/v cache {tuple(k_cache.shape)}/{tuple(v_cache.shape)}, "
            f"rows {tuple(rows.shape)}, shared pages {tuple(shared_pages.shape)}, own_lse/lse "
            f"{[tuple(t.shape) for t in extras]}"
        )
    page_size = k_cache.shape[1]
    if not 1 <= shared_len <= shared_pages.shape[0] * page_size or shared_len >= 2**31:
        raise ValueError(
            f"cascade decode: a shared run of {shared_len} tokens over "
            f"{shared_pages.shape[0]} pages of {page_size}"
        )


def _declines(
    lib, out: torch.Tensor, query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
    rows: torch.Tensor, shared_pages: torch.Tensor, extras: list[torch.Tensor],
) -> bool:
    """Whether the kernel leaves these (consistent) inputs to the torch path."""
    num_q_heads, head_dim = query.shape[1], query.shape[2]
    return bool(
        partly_overlaps(out, query)
        or head_dim % 16
        or head_dim > lib.cascade_max_head_dim
        or rows.shape[0] * (num_q_heads // k_cache.shape[2]) > lib.cascade_max_rows
        or not (k_cache.is_contiguous() and v_cache.is_contiguous())
        or query.stride(2) != 1
        or query.stride(1) != head_dim
        or out.stride(2) != 1
        or out.stride(1) != head_dim
        or not (shared_pages.is_contiguous() and rows.is_contiguous())
        or shared_pages.dtype != torch.int64
        or rows.dtype != torch.int64
        or not all(t.is_contiguous() for t in extras)
    )


__all__ = ["cascade_decode_native"]
