"""Fused per-token layer ops on CPU, fp32 (kernels/cpu/csrc/cpu_ops.c): RMSNorm, SiLU-and-multiply,
in-place rotary embedding, and the K/V scatter into the pages; and the linear layer
(kernels/cpu/csrc/linear.c) over weights packed once by :func:`pack_linear_weight`, and its
weight-only quantized twin (kernels/cpu/csrc/linear_quant.c; linear_amx.c on AMX tiles where
the CPU has them) over ggml blocks packed once by :func:`pack_quant_weight`, with the row
gather of such a table (:func:`quant_rows_native`); and the int8-activation product of the
``--dtype q8`` mode (kernels/cpu/csrc/linear_q8.c) over blocks packed by :func:`pack_q8_weight`.

Each function returns None / False, touching nothing, when the native library is not
available here or the tensors are not what it handles (non-CPU, non-fp32, a layout it does
not take); the caller then runs its torch version, which is also the oracle in the tests.
The model uses them only when the runner's ``native_kernels`` switch is on.
"""

from __future__ import annotations

import torch

from prefixgate.kernels.cpu.host_memory import HugePageArena
from prefixgate.kernels.cpu.library import library
from prefixgate.kernels.quant import BLOCK, QUANT_TYPE_IDS, QuantizedTensor


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
        and _fp32_cpu(key, value)
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


def _epilogue_fits(bias: torch.Tensor | None, residual: torch.Tensor | None, rows: int,
                   out_features: int) -> bool:
    """Whether a linear kernel can read ``bias`` ([N], dense) and ``residual`` ([M, N], unit
    column stride), both fp32 on the CPU (the fp32 and the quantized kernels alike)."""
    if bias is not None and (bias.shape != (out_features,) or not bias.is_contiguous()
                             or not _fp32_cpu(bias)):
        return False
    return residual is None or (residual.shape == (rows, out_features)
                                and (residual.stride(1) == 1 or out_features == 1)
                                and _fp32_cpu(residual))


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
        or not _epilogue_fits(bias, residual, x.shape[0], out_features)
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


# More rows than this dequantize each column block once into an fp32 scratch tile and run the
# fp32 kernel over it (prefill); up to this many (one row tile) expand the weights in registers
# (decode). Both give the same bits; the figures behind the choice are in linear_quant.c.
QUANT_SCRATCH_MIN_ROWS = 16


# From this many rows the quantized linear runs on AMX tiles (kernels/cpu/csrc/linear_amx.c)
# where the CPU and the OS allow it; fewer rows stream the blocks through vector registers
# (linear_quant.c; DRAM-bound there). The figures behind the choice are in linear_amx.c.
QUANT_AMX_MIN_ROWS = 12


def quant_native_available() -> bool:
    """Whether quantized weights can run natively here (the library built, with AVX-512)."""
    lib = library()
    return lib is not None and bool(lib.pg_linear_quant_preferred())


def quant_amx_available() -> bool:
    """Whether the AMX path of the quantized linear runs here: the library was built for a CPU
    with AMX-BF16 and Linux granted this process the tile state (asked once, by the library).
    False elsewhere, and :func:`linear_quant_native` then takes the vector-register kernel for
    every row count."""
    # NOTE: the answer lives on the library handle, not in a cache here: the library can be
    # rebuilt and reloaded (tests do), and a cached answer would send a call to a library
    # whose signatures were never declared
    lib = library()
    return lib is not None and lib.amx_available


def _column_groups(weight) -> torch.Tensor:
    """A GGUF-block weight's bytes as ``[column blocks, k groups, 16 columns, block bytes]``
    (a view; rows past N zero-padded to whole 16-column blocks): what both packings start from."""
    n, k = weight.shape
    blocks = -(-n // LINEAR_COLS)
    data = weight.data
    if blocks * LINEAR_COLS != n:
        data = torch.cat([data, data.new_zeros(blocks * LINEAR_COLS - n, data.shape[1])])
    return data.view(blocks, LINEAR_COLS, k // BLOCK, -1).permute(0, 2, 1, 3)


def pack_quant_weight(
    weight: QuantizedTensor, arena: HugePageArena | None = None
) -> torch.Tensor | None:
    """``weight [N, K]`` repacked for :func:`linear_quant_native` as uint8 ``[ceil(N / 16),
    K / 32 * group bytes]``: per 16-column block, per 32 k, the 16 fp16 scales (and mins),
    then the quants k-major with the 16 columns of a k adjacent (two k per byte for 4-bit);
    zero past N. Allocated from ``arena`` when given; None when the native kernel is not
    available here (see :func:`quant_native_available`)."""
    if not quant_native_available():
        return None
    lib = library()
    grouped = _column_groups(weight)
    blocks, groups = grouped.shape[:2]
    group_bytes = lib.pg_quant_group_bytes(QUANT_TYPE_IDS[weight.qtype])
    scales = [grouped[..., 0:2]]  # d
    if weight.qtype == "Q8_0":
        quants = grouped[..., 2:].transpose(2, 3)  # [.., 32 k, 16 columns]
    else:
        if weight.qtype == "Q4_1":
            scales.append(grouped[..., 2:4])  # m
        nibbles = grouped[..., -16:]
        values = torch.cat([nibbles & 0xF, nibbles >> 4], dim=-1)  # [.., 16 columns, 32 k]
        pairs = values[..., 0::2] | (values[..., 1::2] << 4)  # byte j: k = 2j, 2j + 1
        quants = pairs.transpose(2, 3)  # [.., 16 j, 16 columns]
    parts = [part.reshape(blocks, groups, -1) for part in (*scales, quants)]
    if arena is not None:
        packed = arena.empty((blocks, groups * group_bytes), torch.uint8)
    else:
        packed = torch.empty((blocks, groups * group_bytes), dtype=torch.uint8)
    torch.cat(parts, dim=-1, out=packed.view(blocks, groups, group_bytes))
    return packed


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
    if lib is None or not _takes_packed(lib, x, packed, qtype, out_features, bias, residual):
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


# From this many rows the bf16 linear runs on AMX tiles where the CPU has them; fewer stream the
# weights through AVX512-BF16 dot products (kernels/cpu/csrc/linear_bf16.c). The tiles were
# faster at every row count measured, one row included (docs/precision.md), so AMX takes them
# all where present (a row's sums then never depend on the batch's size); the vector path
# serves CPUs with AVX512-BF16 but no AMX (AMD Zen 4).
BF16_AMX_MIN_ROWS = 1
BF16_K_ALIGN = 32  # the packed bf16 weight's k is padded to this (one AMX tile product)


def bf16_native_available() -> bool:
    """Whether the bf16 linear runs natively here (the library built with AVX512-BF16)."""
    lib = library()
    return lib is not None and bool(lib.pg_linear_bf16_preferred())


def pack_bf16_weight(
    weight: torch.Tensor, arena: HugePageArena | None = None
) -> torch.Tensor | None:
    """``weight [N, K]`` (any float dtype; rounded to bf16, nearest even) as bf16
    ``[ceil(N / 16), Kp / 2, 16, 2]`` for :func:`linear_bf16_native`: per 16-column block, per
    pair of k, the 16 columns' ``(k, k + 1)`` pairs; ``Kp`` = K rounded up to 32, zero-padded
    past N and K. Allocated from ``arena`` when given; None where
    :func:`bf16_native_available` is not, or the weight is not a CPU matrix."""
    if not bf16_native_available() or weight.dim() != 2 or weight.device.type != "cpu":
        return None
    n, k = weight.shape
    blocks = -(-n // LINEAR_COLS)
    k_padded = -(-k // BF16_K_ALIGN) * BF16_K_ALIGN
    padded = torch.zeros((blocks * LINEAR_COLS, k_padded), dtype=torch.bfloat16)
    padded[:n, :k] = weight
    shape = (blocks, k_padded // 2, LINEAR_COLS, 2)
    packed = arena.empty(shape, torch.bfloat16) if arena is not None else torch.empty(
        shape, dtype=torch.bfloat16)
    packed.copy_(padded.view(blocks, LINEAR_COLS, k_padded // 2, 2).transpose(1, 2))
    return packed


def linear_bf16_native(
    x: torch.Tensor,  # [M, K] fp32
    packed: torch.Tensor,  # from pack_bf16_weight
    out_features: int,
    bias: torch.Tensor | None = None,  # [N] fp32
    residual: torch.Tensor | None = None,  # [M, N] fp32: returns residual + x @ W.T (+ bias)
    *,
    amx_min_rows: int = BF16_AMX_MIN_ROWS,
) -> torch.Tensor | None:
    """``x @ W.T (+ bias) (+ residual)`` as a new fp32 ``[M, N]``, ``x`` rounded to bf16 and the
    products summed in fp32; None (nothing computed) for inputs it does not take: rows of ``x``
    dense, ``x`` / bias / residual fp32 on CPU, ``in_features`` of ``x`` within the packed k.
    ``amx_min_rows``: a parameter only so tests can drive both paths."""
    lib = library()
    if (
        lib is None
        or x.dim() != 2
        or packed.dim() != 4
        or packed.dtype != torch.bfloat16
        or not packed.is_contiguous()
        or packed.shape[1] * 2 != -(-x.shape[1] // BF16_K_ALIGN) * BF16_K_ALIGN
        or (x.stride(1) != 1 and x.shape[1] > 1)
        or packed.shape[0] * LINEAR_COLS < out_features
        or not _fp32_cpu(x)
        or not _epilogue_fits(bias, residual, x.shape[0], out_features)
    ):
        return None
    rows = x.shape[0]
    out = torch.empty((rows, out_features), dtype=torch.float32)
    if rows:
        rc = lib.pg_linear_bf16(
            x.data_ptr(), x.stride(0), packed.data_ptr(),
            bias.data_ptr() if bias is not None else None,
            residual.data_ptr() if residual is not None else None,
            residual.stride(0) if residual is not None else 0,
            out.data_ptr(), out.stride(0), rows, out_features, x.shape[1], amx_min_rows,
            torch.get_num_threads(),
        )
        if rc != 0:
            return None
    return out


def q8_native_available() -> bool:
    """Whether the int8-activation linear runs here (the library built with AVX512-VNNI)."""
    lib = library()
    return lib is not None and bool(lib.pg_linear_q8_preferred())


def pack_q8_weight(
    weight: QuantizedTensor, arena: HugePageArena | None = None
) -> torch.Tensor | None:
    """``weight [N, K]`` repacked for :func:`linear_q8_native` as uint8 ``[ceil(N / 16), K / 32
    * group bytes]``: per 16-column block, per 32 k, the 16 fp16 scales (and mins), then the
    quants as VPDPBUSD operands, 4 k of a column per dword (kernels/cpu/csrc/linear_q8.c says
    why not :func:`pack_quant_weight`'s layout); Q8_0 quants offset by 128; zero past N.
    None where :func:`q8_native_available` is not."""
    if not q8_native_available():
        return None
    grouped = _column_groups(weight)
    blocks, groups = grouped.shape[:2]
    scales = [grouped[..., 0:2]]  # d
    if weight.qtype == "Q4_1":
        scales.append(grouped[..., 2:4])  # m
    # Q4: the GGUF's 16 nibble bytes (byte j: k = j, j + 16) as 4 vectors of [16 columns][4 j]
    quants = grouped[..., -16:] if weight.qtype != "Q8_0" else grouped[..., 2:] ^ 0x80
    per_vector = quants.shape[-1] // 4
    quants = quants.reshape(blocks, groups, LINEAR_COLS, per_vector, 4).transpose(2, 3)
    parts = [part.reshape(blocks, groups, -1) for part in (*scales, quants)]
    group_bytes = sum(part.shape[-1] for part in parts)
    if arena is not None:
        packed = arena.empty((blocks, groups * group_bytes), torch.uint8)
    else:
        packed = torch.empty((blocks, groups * group_bytes), dtype=torch.uint8)
    torch.cat(parts, dim=-1, out=packed.view(blocks, groups, group_bytes))
    return packed


def _takes_packed(lib, x: torch.Tensor, packed: torch.Tensor, qtype: str, out_features: int,
                  bias: torch.Tensor | None, residual: torch.Tensor | None) -> bool:
    """Whether the GGUF-block linears (:func:`linear_quant_native`, :func:`linear_q8_native`)
    take these inputs: dense fp32 rows on CPU, a packing of ``qtype`` for ``x``'s K, an
    epilogue that fits."""
    k = x.shape[1] if x.dim() == 2 else -1
    return not (
        qtype not in QUANT_TYPE_IDS
        or x.dim() != 2
        or k % BLOCK
        or (x.stride(1) != 1 and k > 1)
        or packed.dtype != torch.uint8
        or not packed.is_contiguous()
        or packed.shape[0] * LINEAR_COLS < out_features
        or packed.shape[1] != k // BLOCK * lib.pg_quant_group_bytes(QUANT_TYPE_IDS[qtype])
        or not _fp32_cpu(x)
        or not _epilogue_fits(bias, residual, x.shape[0], out_features)
    )


def linear_q8_native(
    x: torch.Tensor,  # [M, K] fp32
    packed: torch.Tensor,  # from pack_q8_weight
    qtype: str,
    out_features: int,
    bias: torch.Tensor | None = None,  # [N]
    residual: torch.Tensor | None = None,  # [M, N]: returns residual + x @ W.T (+ bias)
) -> torch.Tensor | None:
    """``x @ W.T (+ bias) (+ residual)`` as a new fp32 ``[M, N]``, each row of ``x`` quantized to
    int8 per 32 k and the block products summed in integers (kernels/cpu/csrc/linear_q8.c;
    :func:`~prefixgate.kernels.quant.linear_q8_reference` is its torch twin); None (nothing
    computed) for inputs it does not take: rows of ``x`` dense, everything fp32 on CPU."""
    lib = library()
    if lib is None or not _takes_packed(lib, x, packed, qtype, out_features, bias, residual):
        return None
    k = x.shape[1]
    out = torch.empty((x.shape[0], out_features), dtype=torch.float32)
    rc = lib.pg_linear_q8(
        QUANT_TYPE_IDS[qtype], x.data_ptr(), x.stride(0), packed.data_ptr(),
        bias.data_ptr() if bias is not None else None,
        residual.data_ptr() if residual is not None else None,
        residual.stride(0) if residual is not None else 0,
        out.data_ptr(), out.stride(0), x.shape[0], out_features, k, torch.get_num_threads(),
    )
    if rc == -2:
        raise MemoryError(f"linear_q8: no memory for {x.shape[0]} quantized rows of {k}")
    return out if rc == 0 else None


def q8_rows_native(
    ids: torch.Tensor,  # [T] int64
    packed: torch.Tensor,  # from pack_q8_weight
    qtype: str,
    shape: tuple[int, int],  # the weight's [N, K]
) -> torch.Tensor | None:
    """Rows ``W[ids]`` (``[T, K]`` fp32, exactly dequantized) of a :func:`pack_q8_weight`
    weight (the embedding tied to a q8 LM head), as :func:`quant_rows_native` does for its
    layout; None when not handled here.

    Raises:
        IndexError: an id outside ``[0, N)`` (nothing gathered).
    """
    return _packed_rows("pg_q8_rows_f32", ids, packed, qtype, shape)


def quant_rows_native(
    ids: torch.Tensor,  # [T] int64
    packed: torch.Tensor,  # from pack_quant_weight
    qtype: str,
    shape: tuple[int, int],  # the weight's [N, K]
) -> torch.Tensor | None:
    """Rows ``W[ids]`` (``[T, K]`` fp32, exactly dequantized) of a packed weight: the
    embedding lookup straight from the LM head's blocks when the two are tied; None when not
    handled here.

    Raises:
        IndexError: an id outside ``[0, N)`` (nothing gathered).
    """
    return _packed_rows("pg_quant_rows_f32", ids, packed, qtype, shape)


def _packed_rows(kernel: str, ids: torch.Tensor, packed: torch.Tensor, qtype: str,
                 shape: tuple[int, int]) -> torch.Tensor | None:
    """The row gather of :func:`quant_rows_native` and :func:`q8_rows_native` (``kernel``: the
    C entry point of the packing); None when not handled here."""
    lib = library()
    n, k = shape
    if (
        lib is None
        or qtype not in QUANT_TYPE_IDS
        or ids.dim() != 1
        or ids.dtype != torch.int64
        or ids.device.type != "cpu"
        or packed.dtype != torch.uint8
        or not packed.is_contiguous()
        or packed.shape != (-(-n // LINEAR_COLS),
                            k // BLOCK * lib.pg_quant_group_bytes(QUANT_TYPE_IDS[qtype]))
    ):
        return None
    ids = ids.contiguous()
    out = torch.empty((ids.shape[0], k), dtype=torch.float32)
    bad = getattr(lib, kernel)(
        QUANT_TYPE_IDS[qtype], packed.data_ptr(), n, k, ids.data_ptr(), ids.shape[0],
        out.data_ptr(), out.stride(0), torch.get_num_threads(),
    )
    if bad > 0:
        raise IndexError(f"row id {int(ids[bad - 1])} outside [0, {n})")
    return out if bad == 0 else None


__all__ = [
    "BF16_AMX_MIN_ROWS",
    "QUANT_AMX_MIN_ROWS",
    "bf16_native_available",
    "linear_bf16_native",
    "pack_bf16_weight",
    "QUANT_SCRATCH_MIN_ROWS",
    "linear_native",
    "linear_q8_native",
    "pack_q8_weight",
    "q8_native_available",
    "q8_rows_native",
    "linear_quant_native",
    "pack_linear_weight",
    "pack_quant_weight",
    "quant_amx_available",
    "quant_native_available",
    "quant_rows_native",
    "rms_norm_native",
    "rope_native",
    "silu_mul_native",
    "write_kv_native",
]
