"""Native CPU decode attention (kernels/cpu/csrc/paged_decode.c), compiled once per machine.

Why: on CPU, torch can only attend over pages after gathering them into a contiguous buffer,
and its flash kernel is tuned for many query rows, not a decode step's one row per sequence;
together they read and write every K/V byte about three times. The C kernel reads each K/V
row once, in place, for all G query heads of its KV head, spread over torch's own OpenMP
threads (the library links the ``libgomp.so.1`` torch already loaded).

The pages may be fp32 or bf16 (``--kv-dtype bf16``): bf16 elements are widened to fp32 exactly
as they are loaded, and everything after that is fp32, so a bf16 pool gives the torch path's
result on the same pages while streaming half the bytes.

The library is built and loaded by kernels/cpu/library.py (once per machine, with the system C
compiler). No compiler, a failed build, a query or cache dtype it does not take or an
unsupported shape: the callers fall back to the torch path; the outcome is logged once and
visible through :func:`native_status`. The switch is the runner's ``native_kernels``
(``prefixgate serve --native-kernels off`` / ``PREFIXGATE_NATIVE_KERNELS=off``), carried to
the kernels by the attention plan's ``use_native``.
"""

from __future__ import annotations

import torch

from prefixgate.kernels.cpu.attention_inputs import KV_DTYPES, window_arg
from prefixgate.kernels.cpu.library import library, native_status


def native_decode_available() -> bool:
    """Whether the native kernel is (or can be) loaded here; builds it on first call."""
    return library() is not None


def paged_decode_native(
    out: torch.Tensor,  # [T, Hq, D] fp32, written at ``rows``
    query: torch.Tensor,  # [T, Hq, D] fp32
    k_cache: torch.Tensor,  # [num_pages, page_size, Hkv, D] fp32 or bf16, contiguous
    v_cache: torch.Tensor,
    rows: torch.Tensor,  # [B] int64
    pages: torch.Tensor,  # [B, n_pages] int64
    lengths: torch.Tensor,  # [B] int32, tokens attended from the first of ``pages``
    scale: float,
    lse: torch.Tensor | None = None,  # [B, Hq] fp32, filled when given
    num_threads: int | None = None,
    window: int | None = None,
    sinks: torch.Tensor | None = None,  # [Hq] fp32 attention-sink logits (gpt-oss)
) -> bool:
    """Decode attention of one query row per sequence, reading pages in place.

    ``window``: a sliding layer; each row attends only its last ``window`` positions (the
    pages before them are not read).

    ``num_threads``: OpenMP threads (default torch's intra-op count). With at least two
    sequences per thread each sequence is one work item (pages streamed contiguously), else
    each (sequence, KV head) is.

    Returns False (and touches nothing) when the kernel is unavailable or the inputs are not
    what it handles (query/out not fp32, caches neither fp32 nor bf16, non-CPU,
    non-contiguous, group or head dim too large): the caller then runs the torch path.

    Raises:
        ValueError: shapes that do not fit together, a length < 1, a page id outside the
            pool, a row outside ``query`` or a window < 1 (checked before anything is read
            or written).
    """
    window = window_arg(window, "paged decode")
    lib = library()
    if lib is None or query.device.type != "cpu" or k_cache.dtype not in KV_DTYPES or not (
            query.dtype == out.dtype == torch.float32):
        return False
    _check_shapes(out, query, k_cache, v_cache, rows, pages, lengths, lse)
    num_q_heads, head_dim = query.shape[1], query.shape[2]
    page_size, num_kv_heads = k_cache.shape[1], k_cache.shape[2]
    if (_declines(lib, out, query, k_cache, v_cache, rows, pages, lengths, lse)
            or not sinks_accepted(sinks, query)):
        return False
    rc = lib.pg_paged_decode_f32(
        query.data_ptr(), query.stride(0), k_cache.data_ptr(), v_cache.data_ptr(),
        pages.data_ptr(), pages.shape[1], lengths.data_ptr(), rows.data_ptr(),
        out.data_ptr(), out.stride(0), lse.data_ptr() if lse is not None else None,
        rows.shape[0], num_q_heads, num_kv_heads, head_dim, page_size, scale,
        num_threads or torch.get_num_threads(), k_cache.shape[0], query.shape[0],
        int(k_cache.dtype == torch.bfloat16), window,
        sinks.data_ptr() if sinks is not None else None,
    )
    if rc == -2:
        raise ValueError(
            "paged decode: a context length < 1, a page id outside the pool "
            f"[0, {k_cache.shape[0]}) or a query row outside [0, {query.shape[0]})"
        )
    if rc != 0:
        raise MemoryError("native decode kernel could not allocate its score buffer")
    return True


def sinks_accepted(sinks: torch.Tensor | None, query: torch.Tensor) -> bool:
    """Whether the kernels read ``sinks`` as they are: none, or ``[Hq]`` contiguous fp32."""
    return sinks is None or (sinks.dtype == torch.float32 and sinks.is_contiguous()
                             and sinks.shape == (query.shape[1],) and sinks.device.type == "cpu")


def _check_shapes(
    out: torch.Tensor, query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
    rows: torch.Tensor, pages: torch.Tensor, lengths: torch.Tensor, lse: torch.Tensor | None,
) -> None:
    """ValueError unless the shapes fit together (the caller's bug, not an unhandled case)."""
    num_q_heads, head_dim = query.shape[1], query.shape[2]
    batch = rows.shape[0]
    if (
        out.shape != query.shape
        or v_cache.shape != k_cache.shape
        or v_cache.dtype != k_cache.dtype
        or k_cache.shape[3] != head_dim
        or num_q_heads % k_cache.shape[2]
        or rows.dim() != 1
        or pages.dim() != 2
        or pages.shape[0] != batch
        or lengths.shape != (batch,)
        or (lse is not None and lse.numel() != batch * num_q_heads)
    ):
        raise ValueError(
            "paged decode: inconsistent shapes: query/out "
            f"{tuple(query.shape)}/{tuple(out.shape)}, k/v cache {tuple(k_cache.shape)}/"
            f"{tuple(v_cache.shape)}, rows {tuple(rows.shape)}, pages {tuple(pages.shape)}, "
            f"lengths {tuple(lengths.shape)}, lse {None if lse is None else tuple(lse.shape)}"
        )


def _declines(
    lib, out: torch.Tensor, query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
    rows: torch.Tensor, pages: torch.Tensor, lengths: torch.Tensor, lse: torch.Tensor | None,
) -> bool:
    """Whether the kernel leaves these (consistent) inputs to the torch path."""
    head_dim = query.shape[2]
    return bool(
        query.shape[1] // k_cache.shape[2] > lib.max_group
        or head_dim > lib.max_head_dim
        or not (k_cache.is_contiguous() and v_cache.is_contiguous() and out.is_contiguous())
        or query.stride(2) != 1
        or query.stride(1) != head_dim
        or not (pages.is_contiguous() and rows.is_contiguous() and lengths.is_contiguous())
        or pages.dtype != torch.int64
        or rows.dtype != torch.int64
        or lengths.dtype != torch.int32
        or (lse is not None and not (lse.is_contiguous() and lse.dtype == torch.float32))
    )


__all__ = ["KV_DTYPES", "native_decode_available", "native_status", "paged_decode_native",
           "sinks_accepted"]
