"""Fused per-token layer ops on CPU, fp32 (kernels/cpu/csrc/cpu_ops.c): RMSNorm, SiLU-and-multiply,
in-place rotary embedding, and the K/V scatter into the pages; each in two forms:

* a one-off function (``rms_norm_native`` & co) that checks every input and returns None / False,
  touching nothing, when the native library is not available here or the tensors are not what
  it handles (non-CPU, non-fp32, a layout it does not take); the caller then runs its torch
  version, which is also the oracle in the tests;
* a bound op (:class:`NativeRMSNorm`, :class:`NativeSiluMul`, :class:`NativeRope`,
  :class:`NativeKVWriter`) that kernels/layer_ops.py picks once, at load, where the library
  built and the layer's shapes fit: its call checks nothing the load knew.

The linear layers live beside them (linear.py: fp32; linear_bf16.py; linear_quant.py: ggml
blocks and the q8 mode); their names are re-exported here for the callers that import them
from this module. The one-off weight-only quantized call, :func:`linear_quant_native`, stays
here: it asks this module's ``quant_amx_available`` per call, which tests replace to drive
the register kernel on an AMX machine.
"""

from __future__ import annotations

import torch

from prefixgate.kernels.cpu.library import library
from prefixgate.kernels.cpu.linear import (
    LINEAR_COLS,
    epilogue_fits,
    fp32_cpu,
    linear_native,
    pack_linear_weight,
)
from prefixgate.kernels.cpu.linear_bf16 import (
    BF16_AMX_MIN_ROWS,
    BF16_K_ALIGN,
    bf16_native_available,
    linear_bf16_native,
    pack_bf16_weight,
)
from prefixgate.kernels.cpu.linear_quant import (
    QUANT_AMX_MIN_ROWS,
    QUANT_SCRATCH_MIN_ROWS,
    linear_q8_native,
    pack_q8_weight,
    pack_quant_weight,
    q8_native_available,
    q8_rows_native,
    quant_amx_available,
    quant_native_available,
    quant_rows_native,
    takes_packed,
)
from prefixgate.kernels.quant import QUANT_TYPE_IDS

# the old private names, for callers written against them
_fp32_cpu = fp32_cpu
_epilogue_fits = epilogue_fits


def rms_norm_native(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor | None:
    """``weight * x / sqrt(mean(x**2, -1) + eps)`` for ``x [T, H]`` (rows at any stride)."""
    lib = library()
    if (
        lib is None
        or x.dim() != 2
        or weight.shape != (x.shape[1],)
        or x.stride(1) != 1
        or not weight.is_contiguous()
        or not fp32_cpu(x, weight)
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
        or not fp32_cpu(gate_up)
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
        or not fp32_cpu(x, cos, sin)
    ):
        return False
    lib.pg_rope_f32(
        x.data_ptr(), x.stride(0), heads, head_dim, cos.data_ptr(), sin.data_ptr(), rows,
        torch.get_num_threads(),
    )
    return True


def kv_write_accepts(
    key: torch.Tensor,  # [T, Hkv, D]
    value: torch.Tensor,  # [T, Hkv, D]
    k_cache: torch.Tensor,  # [num_pages, page_size, Hkv, D]
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,  # [T] int64, -1 = skip
) -> bool:
    """Whether the native K/V scatter takes these tensors: fp32 rows with dense heads into
    dense fp32 or bf16 caches, an int64 slot vector, all on the CPU."""
    return (
        key.dim() == 3
        and value.shape == key.shape
        and slot_mapping.shape == (key.shape[0],)
        and slot_mapping.dtype == torch.int64
        and slot_mapping.device.type == "cpu"
        and slot_mapping.is_contiguous()
        and key.shape[1:] == k_cache.shape[2:]
        and v_cache.shape == k_cache.shape
        and k_cache.is_contiguous()
        and v_cache.is_contiguous()
        and key.stride()[1:] == (key.shape[2], 1)
        and value.stride()[1:] == (value.shape[2], 1)
        and fp32_cpu(key, value)
        and k_cache.dtype in (torch.float32, torch.bfloat16)
        and v_cache.dtype == k_cache.dtype
        and k_cache.device.type == "cpu"
        and v_cache.device.type == "cpu"
    )


# the native K/V scatter per cache dtype (fp32 rows in)
_KV_WRITERS = {torch.float32: "pg_write_kv_f32", torch.bfloat16: "pg_write_kv_bf16"}


class NativeKVWriter:
    """The native K/V scatter bound to one cache dtype (:func:`bind_kv_writer`).

    NOTE: it checks nothing but the slot bounds (in C, before any write): the caller checked
    :func:`kv_write_accepts` for this layout once (the first layer of the step).
    """

    __slots__ = ("_write",)

    def __init__(self, write: object) -> None:
        self._write = write

    def __call__(self, key: torch.Tensor, value: torch.Tensor, k_cache: torch.Tensor,
                 v_cache: torch.Tensor, slot_mapping: torch.Tensor) -> None:
        num_slots = k_cache.shape[0] * k_cache.shape[1]
        rc = self._write(  # type: ignore[operator]
            key.data_ptr(), key.stride(0), value.data_ptr(), value.stride(0), k_cache.data_ptr(),
            v_cache.data_ptr(), slot_mapping.data_ptr(), key.shape[0],
            key.shape[1] * key.shape[2], num_slots,
        )
        if rc != 0:
            raise ValueError(f"write_kv: a slot outside [-1, {num_slots}) (nothing written)")


def bind_kv_writer(kv_cache: torch.Tensor) -> NativeKVWriter | None:
    """The native K/V scatter for caches like ``kv_cache`` (dtype, device), or None when the
    library is not available here or does not take that dtype."""
    lib = library()
    symbol = _KV_WRITERS.get(kv_cache.dtype)
    if lib is None or symbol is None or kv_cache.device.type != "cpu":
        return None
    return NativeKVWriter(getattr(lib, symbol))


def write_kv_native(
    key: torch.Tensor,  # [T, Hkv, D]
    value: torch.Tensor,  # [T, Hkv, D]
    k_cache: torch.Tensor,  # [num_pages, page_size, Hkv, D]
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,  # [T] int64, -1 = skip
) -> bool:
    """Copy each token's fp32 K/V row into its slot of fp32 caches, or of bf16 caches rounded to
    nearest even (as ``.to(torch.bfloat16)``); False (nothing written) if not handled here.

    A one-off call: it checks everything each time (a step binds :func:`bind_kv_writer` once
    and checks the layout once instead).

    Raises:
        ValueError: a slot outside ``[-1, num_pages * page_size)`` (checked before any write).
    """
    writer = bind_kv_writer(k_cache)
    if writer is None or not kv_write_accepts(key, value, k_cache, v_cache, slot_mapping):
        return False
    writer(key, value, k_cache, v_cache, slot_mapping)
    return True


def linear_quant_native(
    x: torch.Tensor,  # [M, K]
    packed: torch.Tensor,  # from pack_quant_weight
    qtype: str,
    out_features: int,
    bias: torch.Tensor | None = None,  # [N]
    residual: torch.Tensor | None = None,  # [M, N]: returns residual + x @ W.T (+ bias)
    *,
    scratch_min_rows: int = QUANT_SCRATCH_MIN_ROWS,
    amx_min_rows: int = QUANT_AMX_MIN_ROWS,
) -> torch.Tensor | None:
    """``x @ W.T (+ bias) (+ residual)`` as a new ``[M, N]`` fp32 tensor, ``W`` the exact
    dequantized values of the packed blocks; None (nothing computed) for inputs it does not
    take: rows of ``x`` must be dense, everything fp32 on CPU. From ``amx_min_rows`` rows it
    runs on AMX tiles where :func:`quant_amx_available` (as accurate, grouped differently: not
    bit-identical to the other paths). ``scratch_min_rows`` / ``amx_min_rows``: parameters only
    so tests can drive every path of the kernels."""
    lib = library()
    if lib is None or not takes_packed(lib, x, packed, qtype, out_features, bias, residual):
        return None
    k = x.shape[1]
    rows = x.shape[0]
    out = torch.empty((rows, out_features), dtype=torch.float32)
    if rows:
        args = (
            QUANT_TYPE_IDS[qtype], x.data_ptr(), x.stride(0), packed.data_ptr(),
            bias.data_ptr() if bias is not None else None,
            residual.data_ptr() if residual is not None else None,
            residual.stride(0) if residual is not None else 0,
            out.data_ptr(), out.stride(0), rows, out_features, k,
        )
        rc = -1  # the AMX kernel writes nothing when it declines (-1)
        if rows >= amx_min_rows and quant_amx_available():
            rc = lib.pg_linear_quant_amx_f32(*args, torch.get_num_threads())
        if rc != 0:
            rc = lib.pg_linear_quant_f32(*args, scratch_min_rows, torch.get_num_threads())
        if rc != 0:
            return None
    return out


class NativeRMSNorm:
    """:func:`rms_norm_native` bound to one fp32 CPU weight ``[H]`` at load.

    Per call: ``x [T, H]`` fp32 CPU rows with a unit column stride (rows at any stride), which
    every caller in the models passes (the residual stream, a projection's output or a slice
    of it); nothing is checked.
    """

    __slots__ = ("_eps", "_hidden", "_kernel", "_weight", "_weight_ptr")

    def __init__(self, weight: torch.Tensor, eps: float) -> None:
        self._weight = weight.contiguous()
        self._weight_ptr = self._weight.data_ptr()
        self._hidden, self._eps = weight.shape[0], eps
        self._kernel = library().pg_rms_norm_f32

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        out = torch.empty(x.shape, dtype=torch.float32)
        self._kernel(x.data_ptr(), x.stride(0), self._weight_ptr, out.data_ptr(), self._hidden,
                     x.shape[0], self._hidden, self._eps, torch.get_num_threads())
        return out


class NativeHeadNorm:
    """Per-head RMSNorm of q and k heads in place (Qwen3's q/k norms), bound at load to the
    two ``[D]`` fp32 weights: ``qk [T, Hq + Hkv, D]`` (dense heads, rows at any stride: the q|k
    view of a fused projection) -> ``qk``, normed; nothing is checked per call."""

    __slots__ = ("_eps", "_heads", "_kernel", "_pointers", "_weights")

    def __init__(self, q_weight: torch.Tensor, k_weight: torch.Tensor, eps: float,
                 num_heads: int, num_kv_heads: int) -> None:
        self._weights = (q_weight.contiguous(), k_weight.contiguous())
        self._pointers = tuple(w.data_ptr() for w in self._weights)
        self._heads, self._eps = (num_heads, num_kv_heads, q_weight.shape[0]), eps
        self._kernel = library().pg_rms_norm_heads_f32

    def __call__(self, qk: torch.Tensor) -> torch.Tensor:
        self._kernel(qk.data_ptr(), qk.stride(0), *self._heads, *self._pointers, qk.shape[0],
                     self._eps, torch.get_num_threads())
        return qk


class NativeSiluMul:
    """:func:`silu_mul_native` bound at load: ``gate_up [T, 2I]`` (a projection's fresh fp32
    output, dense rows) -> ``[T, I]``; nothing is checked per call."""

    __slots__ = ("_kernel",)

    def __init__(self) -> None:
        self._kernel = library().pg_silu_mul_f32

    def __call__(self, gate_up: torch.Tensor) -> torch.Tensor:
        inter = gate_up.shape[1] // 2
        out = torch.empty((gate_up.shape[0], inter), dtype=torch.float32)
        self._kernel(gate_up.data_ptr(), gate_up.stride(0), out.data_ptr(), gate_up.shape[0],
                     inter, torch.get_num_threads())
        return out


class NativeRope:
    """:func:`rope_native` bound at load to one head size (even): rotates ``x [T, H, D]`` in
    place and returns it. Per call: dense heads (``x.stride() == (>= H * D, D, 1)``, as the q|k
    view of a fused projection and a norm's output are) and ``cos`` / ``sin`` contiguous fp32
    ``[T, 1, D/2]`` (the RoPE table's rows); nothing is checked."""

    __slots__ = ("_head_dim", "_kernel")

    def __init__(self, head_dim: int) -> None:
        self._head_dim = head_dim
        self._kernel = library().pg_rope_f32

    def __call__(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        self._kernel(x.data_ptr(), x.stride(0), x.shape[1], self._head_dim, cos.data_ptr(),
                     sin.data_ptr(), x.shape[0], torch.get_num_threads())
        return x


__all__ = [
    "BF16_AMX_MIN_ROWS",
    "BF16_K_ALIGN",
    "LINEAR_COLS",
    "NativeHeadNorm",
    "NativeKVWriter",
    "NativeRMSNorm",
    "NativeRope",
    "NativeSiluMul",
    "QUANT_AMX_MIN_ROWS",
    "QUANT_SCRATCH_MIN_ROWS",
    "bf16_native_available",
    "bind_kv_writer",
    "kv_write_accepts",
    "linear_bf16_native",
    "linear_native",
    "linear_q8_native",
    "linear_quant_native",
    "pack_bf16_weight",
    "pack_linear_weight",
    "pack_q8_weight",
    "pack_quant_weight",
    "q8_native_available",
    "q8_rows_native",
    "quant_amx_available",
    "quant_native_available",
    "quant_rows_native",
    "rms_norm_native",
    "rope_native",
    "silu_mul_native",
    "write_kv_native",
]
