"""The fp32 linear layer on the CPU (kernels/cpu/csrc/linear.c) over weights packed once by
:func:`pack_linear_weight`, what every native linear shares (the column block, the epilogue
check), and :class:`NativeLinear`: a packed weight bound to its kernel at load.

The one-off functions (``linear_native`` and its twins in linear_bf16.py / linear_quant.py)
check every input and return None for what they do not take; they serve tests and benchmarks.
A model binds a :class:`NativeLinear` once (kernels/layer_ops.py), whose call checks nothing the
load already knew.
"""

from __future__ import annotations

import torch

from prefixgate.kernels.cpu.host_memory import HugePageArena
from prefixgate.kernels.cpu.library import library

LINEAR_COLS = 16  # output columns per packed block (linear.c's COLS)


def fp32_cpu(*tensors: torch.Tensor) -> bool:
    """Whether every tensor is fp32 on the CPU (what the native kernels read)."""
    return all(t.dtype == torch.float32 and t.device.type == "cpu" for t in tensors)


def pack_linear_weight(
    weight: torch.Tensor, arena: HugePageArena | None = None
) -> torch.Tensor | None:
    """``weight [N, K]`` as ``[ceil(N / 16), K, 16]`` (zero-padded columns) for
    :func:`linear_native`, allocated from ``arena`` when given; None when the native library
    is not available, was not built for AVX-512 (its tiles would spill; the vendor GEMM is
    better there) or the weight is not fp32 on CPU."""
    lib = library()
    if lib is None or not lib.pg_linear_preferred() or weight.dim() != 2 or not fp32_cpu(weight):
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


def epilogue_fits(bias: torch.Tensor | None, residual: torch.Tensor | None, rows: int,
                  out_features: int) -> bool:
    """Whether a linear kernel can read ``bias`` ([N], dense) and ``residual`` ([M, N], unit
    column stride), both fp32 on the CPU (the fp32 and the quantized kernels alike)."""
    if bias is not None and (bias.shape != (out_features,) or not bias.is_contiguous()
                             or not fp32_cpu(bias)):
        return False
    return residual is None or (residual.shape == (rows, out_features)
                                and (residual.stride(1) == 1 or out_features == 1)
                                and fp32_cpu(residual))


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
        or not fp32_cpu(x, packed)
        or not epilogue_fits(bias, residual, x.shape[0], out_features)
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


class NativeLinear:
    """A natively packed weight bound to its C kernel at load (kernels/layer_ops.py chose it).

    ``y = x @ W.T (+ bias)``; :meth:`add_to` fuses ``+ residual``. What the load knew (the
    packing, the bias, the sizes, the kernel) is not checked per call. Per call: a column
    stride other than 1 (a transposed view) takes one dense copy first, and an empty batch
    skips the kernel; inputs must be fp32 CPU rows ``[M, K]`` (every activation of the models
    is: they run these ops only where the load found the native kernels apply).
    Subclasses bind one kernel's arguments (:meth:`_run`).
    """

    __slots__ = ("_bias_ptr", "_packed_ptr", "data", "in_features", "out_features")

    def __init__(self, packed: torch.Tensor, bias: torch.Tensor | None, out_features: int,
                 in_features: int) -> None:
        bias = None if bias is None else bias.contiguous()
        self.data = (packed, bias)  # the pointers below stay valid while the op lives
        self._packed_ptr = packed.data_ptr()
        self._bias_ptr = None if bias is None else bias.data_ptr()
        self.out_features, self.in_features = out_features, in_features

    def __call__(self, x: torch.Tensor, residual: torch.Tensor | None = None) -> torch.Tensor:
        if x.shape[-1] != self.in_features:
            raise ValueError(f"linear: input {tuple(x.shape)} does not fit the "
                             f"[{self.out_features}, {self.in_features}] weight")
        if x.stride(1) != 1 or (residual is not None and residual.stride(1) != 1):
            x = x.contiguous()
            residual = None if residual is None else residual.contiguous()
        rows = x.shape[0]
        out = torch.empty((rows, self.out_features), dtype=torch.float32)
        if rows:
            if residual is None:
                self._run(x, None, 0, out, rows)
            else:
                self._run(x, residual.data_ptr(), residual.stride(0), out, rows)
        return out

    def add_to(self, x: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        """``residual + x @ W.T (+ bias)``, the add fused into the kernel."""
        return self(x, residual)

    def _run(self, x: torch.Tensor, res_ptr: int | None, res_stride: int, out: torch.Tensor,
             rows: int) -> None:
        raise NotImplementedError


class NativeLinearF32(NativeLinear):
    """An fp32 weight packed by :func:`pack_linear_weight` (linear.c)."""

    __slots__ = ("_kernel",)

    def __init__(self, packed: torch.Tensor, bias: torch.Tensor | None, out_features: int,
                 in_features: int) -> None:
        super().__init__(packed, bias, out_features, in_features)
        self._kernel = library().pg_linear_f32

    def _run(self, x, res_ptr, res_stride, out, rows):  # type: ignore[no-untyped-def]
        self._kernel(x.data_ptr(), x.stride(0), self._packed_ptr, self._bias_ptr, res_ptr,
                     res_stride, out.data_ptr(), out.stride(0), rows, self.out_features,
                     self.in_features, torch.get_num_threads())


__all__ = ["LINEAR_COLS", "NativeLinear", "NativeLinearF32", "epilogue_fits", "fp32_cpu",
           "linear_native", "pack_linear_weight"]
