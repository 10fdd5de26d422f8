"""Helpers shared by the Triton launchers (imported only when the Triton backend is used)."""

from __future__ import annotations

import functools
import os

import torch
import triton.language as tl

from prefixgate.kernels.checks import require

_TL_DTYPES = {
    torch.float32: tl.float32,
    torch.float16: tl.float16,
    torch.bfloat16: tl.bfloat16,
}


def interpreting() -> bool:
    """True when Triton runs kernels in its CPU interpreter (``TRITON_INTERPRET=1``)."""
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def check_triton_device(tensor: torch.Tensor) -> None:
    """Triton kernels need CUDA tensors, or CPU tensors under the interpreter."""
    if tensor.device.type != "cuda" and not interpreting():
        raise ValueError(
            f"the triton backend needs CUDA tensors (got {tensor.device}); "
            "set TRITON_INTERPRET=1 to run it on CPU, or use the torch backend"
        )


def compute_dtype(cache_dtype: torch.dtype) -> tl.dtype:
    """The dtype K/V tiles are fed to ``tl.dot`` in.

    On GPU that is the cache dtype itself. NOTE: Triton's CPU interpreter mis-computes
    ``tl.dot`` on bfloat16 (it multiplies the raw uint16 bit patterns), so under the
    interpreter bf16 tiles are widened to fp32 first; the kernels are otherwise identical.
    """
    if cache_dtype not in _TL_DTYPES:
        raise ValueError(f"unsupported KV cache dtype {cache_dtype}; use one of {list(_TL_DTYPES)}")
    if cache_dtype == torch.bfloat16 and interpreting():
        return tl.float32
    return _TL_DTYPES[cache_dtype]


# What the interpreter pretends to have, so CPU tests pick the same split counts as an H100/H200.
NOMINAL_SMS = 132


def dot_precision(cache_dtype: torch.dtype) -> str:
    """``tl.dot`` input precision: exact IEEE for fp32 caches (Triton's default would round
    them to tf32), the default for 16-bit caches, whose products are exact anyway."""
    return "ieee" if compute_dtype(cache_dtype) == tl.float32 else "tf32"


@functools.cache
def _cuda_sms(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def device_sms(device: torch.device) -> int:
    """Streaming multiprocessors of the device a tensor lives on (``NOMINAL_SMS`` off CUDA)."""
    if device.type != "cuda":
        return NOMINAL_SMS
    return _cuda_sms(device.index if device.index is not None else torch.cuda.current_device())


def require_inner_contiguous(
    query: torch.Tensor, out: torch.Tensor, block_tables: torch.Tensor
) -> None:
    """What the decode and prefill launchers index with unit stride: a head's row of ``query``
    and ``out``, and a sequence's row of ``block_tables``."""
    require(query.stride(-1) == 1, f"query last dim must be contiguous, strides {query.stride()}")
    require(out.stride(-1) == 1, f"out last dim must be contiguous, strides {out.stride()}")
    require(
        block_tables.stride(1) == 1,
        f"block_tables rows must be contiguous, strides {block_tables.stride()}",
    )
