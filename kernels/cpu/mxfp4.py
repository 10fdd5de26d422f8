"""The native MXFP4 linear layer (kernels/cpu/csrc/linear_mxfp4.c) and the layer object that
binds it, or the torch reference where the library is off, once at load.

The activations stay fp32 (no int8 quantization): the kernel expands each block to exact fp32
weights in registers, so it differs from "dequantize, then matmul" only in the fp32 summation
order. Paths (the C file's): 0 the best this build has, 1 plain C, 2 AVX2, 3 AVX-512.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from prefixgate.kernels.cpu.library import library
from prefixgate.kernels.torch_cpu.mxfp4 import Mxfp4Tensor

PATH_BEST, PATH_C, PATH_AVX2, PATH_AVX512 = 0, 1, 2, 3
PATH_NAMES = {PATH_C: "c", PATH_AVX2: "avx2", PATH_AVX512: "avx512"}


def mxfp4_native_path() -> int | None:
    """The best native path this machine's library runs (1 C, 2 AVX2, 3 AVX-512), or None when
    the library is unavailable."""
    lib = library()
    return None if lib is None else int(lib.pg_linear_mxfp4_best())


def linear_mxfp4(x: torch.Tensor, weight: Mxfp4Tensor, bias: torch.Tensor | None = None, *,
                 path: int = PATH_BEST, out: torch.Tensor | None = None) -> torch.Tensor:
    """``x [M, K] @ W^T (+ bias)`` on the native kernel; fp32 ``[M, N]`` (written into
    ``out`` when given: any fp32 ``[M, N]`` view with unit column stride, e.g. a column slice
    of a wider output).

    Raises:
        RuntimeError: no native library, or it lacks ``path``.
        ValueError: shapes or dtypes that do not fit.
    """
    lib = library()
    if lib is None:
        raise RuntimeError("the native CPU kernels are unavailable; use linear_mxfp4_reference")
    rows, cols = weight.shape
    if x.dim() != 2 or x.shape[1] != cols or x.dtype != torch.float32 or x.device.type != "cpu":
        raise ValueError(f"linear_mxfp4: x must be fp32 [M, {cols}] on CPU, got {x.dtype} "
                         f"{tuple(x.shape)} on {x.device}")
    if bias is not None and (bias.dtype != torch.float32 or bias.shape != (rows,)):
        raise ValueError(f"linear_mxfp4: bias must be fp32 [{rows}]")
    if out is None:
        out = torch.empty(x.shape[0], rows, dtype=torch.float32)
    elif out.shape != (x.shape[0], rows) or out.dtype != torch.float32 or out.stride(1) != 1:
        raise ValueError(f"linear_mxfp4: out must be an fp32 [{x.shape[0]}, {rows}] view with "
                         f"unit column stride")
    if x.stride(1) != 1:
        x = x.contiguous()
    rc = lib.pg_linear_mxfp4(
        x.data_ptr(), x.stride(0), weight.nibbles.data_ptr(), weight.scales.data_ptr(),
        bias.data_ptr() if bias is not None else None, out.data_ptr(), out.stride(0),
        x.shape[0], rows, cols, path, torch.get_num_threads(),
    )  # fmt: skip
    if rc != 0:
        raise RuntimeError(f"pg_linear_mxfp4 failed ({rc}): path {path} not built here"
                           if rc == -2 else f"pg_linear_mxfp4 failed ({rc})")
    return out


class Mxfp4Linear:
    """One linear layer over MXFP4 matrices stacked by rows (gate | up), ``x [n, K] ->
    [n, N]`` (+ bias), in the activations' dtype, bound once at load:
      * ``native`` on CPU: the native kernel on each part's blocks, into its columns of the
        output (the parts are never concatenated: no second copy of the experts);
      * else on CPU: the torch reference, expanding only these matrices per call;
      * on another device (``device``): the matrices expanded once to ``dtype`` there (the GPU
        path has no MXFP4 kernel: it keeps the checkpoint's values, not its size).
    """

    def __init__(self, parts: Sequence[Mxfp4Tensor], bias: torch.Tensor | None, *,
                 native: bool, device: torch.device | str = "cpu",
                 dtype: torch.dtype = torch.float32) -> None:
        if any(p.shape[1] != parts[0].shape[1] for p in parts):
            raise ValueError("Mxfp4Linear: every part needs the same width")
        self.device = torch.device(device)
        self.in_features = parts[0].shape[1]
        self.out_features = sum(p.shape[0] for p in parts)
        on_cpu = self.device.type == "cpu"
        self.parts = tuple(parts) if on_cpu else ()
        self.expanded = None if on_cpu else torch.cat(
            [p.dequantize(dtype) for p in parts]).to(self.device)
        self.bias = None if bias is None else bias.to(self.device, torch.float32).contiguous()
        self.native = on_cpu and native and mxfp4_native_path() is not None

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self.expanded is not None:
            out = x @ self.expanded.T
            return out if self.bias is None else out + self.bias.to(out.dtype)
        if not self.native:
            weight = torch.cat([p.dequantize() for p in self.parts])
            out = x.float() @ weight.T
            return (out if self.bias is None else out + self.bias).to(x.dtype)
        x32 = x.float()
        out = torch.empty(x.shape[0], self.out_features, dtype=torch.float32)
        start = 0
        for part in self.parts:
            end = start + part.shape[0]
            bias = None if self.bias is None else self.bias[start:end]
            linear_mxfp4(x32, part, bias, out=out[:, start:end])
            start = end
        return out.to(x.dtype)


__all__ = ["PATH_AVX2", "PATH_AVX512", "PATH_BEST", "PATH_C", "PATH_NAMES", "Mxfp4Linear",
           "linear_mxfp4", "mxfp4_native_path"]
