"""Linear layers over weights still in ggml blocks (GGUF Q4_0 / Q4_1 / Q8_0), on the CPU.

* weight-only: kernels/cpu/csrc/linear_quant.c (linear_amx.c on AMX tiles where the CPU has
  them) over blocks packed once by :func:`pack_quant_weight` (the one-off call,
  ``linear_quant_native``, is in ops.py, where the tests swap its AMX probe), and the row
  gather of such a table (:func:`quant_rows_native`: the embedding tied to the LM head);
* int8 activations, the ``--dtype q8`` mode (kernels/cpu/csrc/linear_q8.c): :func:`linear_q8_native`
  over blocks packed by :func:`pack_q8_weight`, and its row gather (:func:`q8_rows_native`).

The one-off functions check everything and return None for what they do not take (tests,
benchmarks); a model binds :class:`NativeLinearQuant` / :class:`NativeLinearQ8` once at load.
"""

from __future__ import annotations

import torch

from prefixgate.kernels.cpu.host_memory import HugePageArena
from prefixgate.kernels.cpu.library import library
from prefixgate.kernels.cpu.linear import LINEAR_COLS, NativeLinear, epilogue_fits, fp32_cpu
from prefixgate.kernels.quant import BLOCK, QUANT_TYPE_IDS, QuantizedTensor

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


def takes_packed(lib, x: torch.Tensor, packed: torch.Tensor, qtype: str, out_features: int,
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
        or not fp32_cpu(x)
        or not epilogue_fits(bias, residual, x.shape[0], out_features)
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
    if lib is None or not takes_packed(lib, x, packed, qtype, out_features, bias, residual):
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


class NativeLinearQuant(NativeLinear):
    """A ggml-block weight packed by :func:`pack_quant_weight` (linear_quant.c, weight-only).

    Per call, by the row count only (known per call): from :data:`QUANT_AMX_MIN_ROWS` rows the
    AMX kernel where the load found it (:func:`quant_amx_available`), falling back to the
    register kernel if it declines (it writes nothing then: no memory for its tiles).
    """

    __slots__ = ("_amx", "_kernel", "_qtype", "_shape", "qtype")

    def __init__(self, packed: torch.Tensor, bias: torch.Tensor | None, qtype: str,
                 out_features: int, in_features: int) -> None:
        super().__init__(packed, bias, out_features, in_features)
        lib = library()
        self.qtype, self._qtype = qtype, QUANT_TYPE_IDS[qtype]
        self._kernel = lib.pg_linear_quant_f32
        self._amx = lib.pg_linear_quant_amx_f32 if quant_amx_available() else None
        self._shape = (out_features, in_features)

    def _run(self, x, res_ptr, res_stride, out, rows):  # type: ignore[no-untyped-def]
        args = (self._qtype, x.data_ptr(), x.stride(0), self._packed_ptr, self._bias_ptr,
                res_ptr, res_stride, out.data_ptr(), out.stride(0), rows, self.out_features,
                self.in_features)
        threads = torch.get_num_threads()
        if rows >= QUANT_AMX_MIN_ROWS and self._amx is not None and self._amx(*args, threads) == 0:
            return
        if self._kernel(*args, QUANT_SCRATCH_MIN_ROWS, threads) != 0:
            raise MemoryError(f"linear_quant: no memory for {rows} rows of {self.in_features}")

    def rows(self, ids: torch.Tensor) -> torch.Tensor:
        """``W[ids]`` (``[T, K]`` fp32, exactly dequantized): the embedding from the blocks."""
        out = quant_rows_native(ids, self.data[0], self.qtype, self._shape)
        if out is None:
            raise ValueError(f"rows(): ids {ids.dtype} on {ids.device} must be 1-D int64 on CPU")
        return out


class NativeLinearQ8(NativeLinear):
    """A ggml-block weight packed by :func:`pack_q8_weight` (linear_q8.c): the q8 mode's int8
    activations."""

    __slots__ = ("_kernel", "_qtype", "_shape", "qtype")

    def __init__(self, packed: torch.Tensor, bias: torch.Tensor | None, qtype: str,
                 out_features: int, in_features: int) -> None:
        super().__init__(packed, bias, out_features, in_features)
        self.qtype, self._qtype = qtype, QUANT_TYPE_IDS[qtype]
        self._kernel = library().pg_linear_q8
        self._shape = (out_features, in_features)

    def _run(self, x, res_ptr, res_stride, out, rows):  # type: ignore[no-untyped-def]
        rc = self._kernel(self._qtype, x.data_ptr(), x.stride(0), self._packed_ptr,
                          self._bias_ptr, res_ptr, res_stride, out.data_ptr(), out.stride(0),
                          rows, self.out_features, self.in_features, torch.get_num_threads())
        if rc != 0:  # -2: the quantized rows' buffer; nothing else declines once bound
            raise MemoryError(f"linear_q8: no memory for {rows} quantized rows of "
                              f"{self.in_features}")

    def rows(self, ids: torch.Tensor) -> torch.Tensor:
        """``W[ids]`` (``[T, K]`` fp32, exactly dequantized): the embedding from the blocks."""
        out = q8_rows_native(ids, self.data[0], self.qtype, self._shape)
        if out is None:
            raise ValueError(f"rows(): ids {ids.dtype} on {ids.device} must be 1-D int64 on CPU")
        return out


__all__ = [
    "QUANT_AMX_MIN_ROWS",
    "QUANT_SCRATCH_MIN_ROWS",
    "NativeLinearQ8",
    "NativeLinearQuant",
    "linear_q8_native",
    "pack_q8_weight",
    "pack_quant_weight",
    "q8_native_available",
    "q8_rows_native",
    "quant_amx_available",
    "quant_native_available",
    "quant_rows_native",
]
