"""The bf16 linear layer on the CPU (kernels/cpu/csrc/linear_bf16.c: AMX tiles, or AVX512-BF16
where AMX is absent) of the ``--dtype bf16`` mode: fp32 activations in and out, the input rounded
to bf16 for the products only, summed in fp32, bias and residual fp32 (docs/precision.md)."""

from __future__ import annotations

import torch

from prefixgate.kernels.cpu.host_memory import HugePageArena
from prefixgate.kernels.cpu.library import library
from prefixgate.kernels.cpu.linear import LINEAR_COLS, NativeLinear, epilogue_fits, fp32_cpu

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
        or not fp32_cpu(x)
        or not epilogue_fits(bias, residual, x.shape[0], out_features)
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


class NativeLinearBF16(NativeLinear):
    """A bf16 weight packed by :func:`pack_bf16_weight` (linear_bf16.c), fp32 in and out."""

    __slots__ = ("_kernel",)

    def __init__(self, packed: torch.Tensor, bias: torch.Tensor | None, out_features: int,
                 in_features: int) -> None:
        super().__init__(packed, bias, out_features, in_features)
        self._kernel = library().pg_linear_bf16

    def _run(self, x, res_ptr, res_stride, out, rows):  # type: ignore[no-untyped-def]
        rc = self._kernel(x.data_ptr(), x.stride(0), self._packed_ptr, self._bias_ptr, res_ptr,
                          res_stride, out.data_ptr(), out.stride(0), rows, self.out_features,
                          self.in_features, BF16_AMX_MIN_ROWS, torch.get_num_threads())
        if rc != 0:  # its one failure once the load chose it: no memory for the bf16 rows
            raise MemoryError(f"linear_bf16: no memory for {rows} rows of {self.in_features}")


__all__ = ["BF16_AMX_MIN_ROWS", "BF16_K_ALIGN", "NativeLinearBF16", "bf16_native_available",
           "linear_bf16_native", "pack_bf16_weight"]
