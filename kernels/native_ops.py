"""Fused per-token layer ops on CPU, fp32 (kernels/csrc/cpu_ops.c): RMSNorm, SiLU-and-multiply,
in-place rotary embedding, and the K/V scatter into the pages; and the linear layer
(kernels/csrc/linear.c) over weights packed once by :func:`pack_linear_weight`.

Each function returns None / False, touching nothing, when the native library is not
available here or the tensors are not what it handles (non-CPU, non-fp32, a layout it does
not take); the caller then runs its torch version, which is also the oracle in the tests.
The model uses them only when the runner's ``native_kernels`` switch is on.
"""

from __future__ import annotations

import torch

from prefixgate.kernels.host_memory import HugePageArena
from prefixgate.kernels.native_lib import library


def _fp32_cpu(*tensors: torch.Tensor) -> bool:
    return all(t.dtype == torch.float32 and t.device.type == "cpu" for t in tensors)


def rms_norm_native(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor | None:
    """``weight * x / sqrt(mean(x**2, -1) + eps)`` for ``x [T, H]`` (rows at any stride)."""
    lib = library()
    if (
        lib is None
        or x.dim() != 2
        or weight.shape != (x.shape[1],)
        or x.stride(1) != 1
        or not weight.is_contiguous()
        or not _fp32_cpu(x, weight)
    ):
        return None
    out = torch.empty(x.shape, dtype=x.dtype)
    lib.pg_rms_norm_f32(
        x.data_ptr(), x.stride(0), weight.data_ptr(), out.data_ptr(), out.stride(0),
        x.shape[0], x.shape[1], eps, torch.get_num_threads(),
    )
    return out


def silu_mul_native(gate_up: torch.Tensor) -> torch.Tensor | None:
    """``silu(gate) * up`` for ``gate_up [T, 2I]`` (gate first); returns ``[T, I]``."""
    lib = library()
    if (
        lib is None
        or gate_up.dim() != 2
        or gate_up.shape[1] % 2
        or gate_up.stride(1) != 1
        or not _fp32_cpu(gate_up)
    ):
        return None
    inter = gate_up.shape[1] // 2
    out = torch.empty((gate_up.shape[0], inter), dtype=gate_up.dtype)
    lib.pg_silu_mul_f32(
        gate_up.data_ptr(), gate_up.stride(0), out.data_ptr(), gate_up.shape[0], inter,
        torch.get_num_threads(),
    )
    return out


def rope_native(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> bool:
    """Rotate ``x [T, H, D]`` in place (rotate-half pairs ``(i, i + D/2)``) by per-token
    angles ``cos`` / ``sin`` (``T * D/2`` values each, contiguous, e.g. ``[T, 1, D/2]``).

    The heads of a row must be dense (``x.stride() == (any, D, 1)``); rows may be strided, as
    when ``x`` is the q|k part of a fused qkv output.
    """
    lib = library()
    if lib is None or x.dim() != 3:
        return False
    rows, heads, head_dim = x.shape
    half = head_dim // 2
    if (
        head_dim % 2
        or x.stride(2) != 1
        or x.stride(1) != head_dim
        or x.stride(0) < heads * head_dim  # overlapping rows would rotate twice
        or cos.numel() != rows * half
        or sin.numel() != rows * half
        or not (cos.is_contiguous() and sin.is_contiguous())
        or not _fp32_cpu(x, cos, sin)
    ):
        return False
    lib.pg_rope_f32(
        x.data_ptr(), x.stride(0), heads, head_dim, cos.data_ptr(), sin.data_ptr(), rows,
        torch.get_num_threads(),
    )
    return True


def write_kv_native(
    key: torch.Tensor,  # [T, Hkv, D]
    value: torch.Tensor,  # [T, Hkv, D]
    k_cache: torch.Tensor,  # [num_pages, page_size, Hkv, D]
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,  # [T] int64, -1 = skip
) -> bool:
    """Copy each token's K/V row into its slot; False (nothing written) if not handled here.

    Raises:
        ValueError: a slot outside ``[-1, num_pages * page_size)`` (checked before any write).
    """
    lib = library()
    if (
        lib is None
        or key.dim() != 3
        or value.shape != key.shape
        or slot_mapping.shape != (key.shape[0],)
        or slot_mapping.dtype != torch.int64
        or slot_mapping.device.type != "cpu"
        or not slot_mapping.is_contiguous()
        or key.shape[1:] != k_cache.shape[2:]
        or v_cache.shape != k_cache.shape
        or not (k_cache.is_contiguous() and v_cache.is_contiguous())
        or key.stride()[1:] != (key.shape[2], 1)
        or value.stride()[1:] != (value.shape[2], 1)
        or not _fp32_cpu(key, value, k_cache, v_cache)
    ):
        return False
    num_slots = k_cache.shape[0] * k_cache.shape[1]
    rc = lib.pg_write_kv_f32(
        key.data_ptr(), key.stride(0), value.data_ptr(), value.stride(0), k_cache.data_ptr(),
        v_cache.data_ptr(), slot_mapping.data_ptr(), key.shape[0], key.shape[1] * key.shape[2],
        num_slots,
    )
    if rc != 0:
        raise ValueError(f"write_kv: a slot outside [-1, {num_slots}) (nothing written)")
    return True


LINEAR_COLS = 16  # output columns per packed block (linear.c's COLS)


def pack_linear_weight(
    weight: torch.Tensor, arena: HugePageArena | None = None
) -> torch.Tensor | None:
    """``weight [N, K]`` as ``[ceil(N / 16), K, 16]`` (zero-padded columns) for
    :func:`linear_native`, allocated from ``arena`` when given; None when the native library
    is not available, was not built for AVX-512 (its tiles would spill; the vendor GEMM is
    better there) or the weight is not fp32 on CPU."""
    lib = library()
    if lib is None or not lib.pg_linear_preferred() or weight.dim() != 2 or not _fp32_cpu(weight):
        return None
    n, k = weight.shape
    blocks = -(-n // LINEAR_COLS)
    shape = (blocks, k, LINEAR_COLS)
    if arena is not None:
        packed = arena.empty(shape, weight.dtype)
    else:
        packed = torch.empty(shape, dtype=weight.dtype)
    full = n // LINEAR_COLS
    packed[:full] = weight[: full * LINEAR_COLS].view(full, LINEAR_COLS, k).transpose(1, 2)
    if full < blocks:  # the last, partial block: its missing columns are zero
        packed[full].zero_()
        packed[full, :, : n - full * LINEAR_COLS] = weight[full * LINEAR_COLS :].t()
    return packed


def linear_native(
    x: torch.Tensor,  # [M, K]
    packed: torch.Tensor,  # from pack_linear_weight
    out_features: int,
    bias: torch.Tensor | None = None,  # [N]
    residual: torch.Tensor | None = None,  # [M, N]: returns residual + x @ W.T (+ bias)
) -> torch.Tensor | None:
    """``x @ W.T (+ bias) (+ residual)`` as a new ``[M, N]`` tensor; None (nothing computed)
    for inputs it does not take: rows of ``x`` must be dense, everything fp32 on CPU."""
    lib = library()
    k = packed.shape[1] if packed.dim() == 3 else -1
    if (
        lib is None
        or x.dim() != 2
        or x.shape[1] != k
        or (x.stride(1) != 1 and k > 1)
        or packed.shape[2] != LINEAR_COLS
        or not packed.is_contiguous()
        or packed.shape[0] * LINEAR_COLS < out_features
        or not _fp32_cpu(x, packed)
        or (bias is not None and (bias.shape != (out_features,) or not bias.is_contiguous()
                                  or not _fp32_cpu(bias)))
        or (residual is not None and (residual.shape != (x.shape[0], out_features)
                                      or (residual.stride(1) != 1 and out_features > 1)
                                      or not _fp32_cpu(residual)))
    ):
        return None
    rows = x.shape[0]
    out = torch.empty((rows, out_features), dtype=torch.float32)
    if rows:
        lib.pg_linear_f32(
            x.data_ptr(), x.stride(0), packed.data_ptr(),
            bias.data_ptr() if bias is not None else None,
            residual.data_ptr() if residual is not None else None,
            residual.stride(0) if residual is not None else 0,
            out.data_ptr(), out.stride(0), rows, out_features, k, torch.get_num_threads(),
        )
    return out


__all__ = [
    "linear_native",
    "pack_linear_weight",
    "rms_norm_native",
    "rope_native",
    "silu_mul_native",
    "write_kv_native",
]
