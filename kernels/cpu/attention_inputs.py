"""What the native attention kernels (decode.py, prefill.py, cascade.py) check of their tensors
before a C kernel reads them: the dtypes they take, the head layout they need, and an output
that would overwrite its own query while reading it."""

from __future__ import annotations

import torch

# the page dtypes the kernels read (bf16 widened exactly in registers)
KV_DTYPES = (torch.float32, torch.bfloat16)


def takes_dtypes(out: torch.Tensor, query: torch.Tensor, k_cache: torch.Tensor,
                 v_cache: torch.Tensor, *others: torch.Tensor) -> bool:
    """Every tensor on CPU, fp32 query and output, K and V caches of one dtype in KV_DTYPES."""
    return (
        all(t.device.type == "cpu" for t in (out, query, k_cache, v_cache, *others))
        and query.dtype == out.dtype == torch.float32
        and k_cache.dtype == v_cache.dtype
        and k_cache.dtype in KV_DTYPES
    )


def window_arg(window: int | None, kernel: str) -> int:
    """The C kernels' ``window`` argument (0: no window); ValueError for a window < 1."""
    if window is not None and window < 1:
        raise ValueError(f"{kernel}: window must be positive, got {window}")
    return window or 0


def heads_inconsistent(out: torch.Tensor, query: torch.Tensor, k_cache: torch.Tensor,
                       v_cache: torch.Tensor) -> bool:
    """True unless query and output are ``[n, Hq, D]`` alike and the caches
    ``[pages, page_size, Hkv, D]`` alike, with ``Hkv`` dividing ``Hq``."""
    return (
        query.dim() != 3
        or out.shape != query.shape
        or k_cache.dim() != 4
        or v_cache.shape != k_cache.shape
        or k_cache.shape[3] != query.shape[2]
        or k_cache.shape[2] < 1
        or query.shape[1] % k_cache.shape[2] != 0
    )


def partly_overlaps(out: torch.Tensor, query: torch.Tensor) -> bool:
    """Whether ``out`` is a shifted view of ``query``'s storage: written while still read."""
    return (
        out.untyped_storage().data_ptr() == query.untyped_storage().data_ptr()
        and out.data_ptr() != query.data_ptr()
    )


__all__ = ["KV_DTYPES", "heads_inconsistent", "partly_overlaps", "takes_dtypes"]
