"""A linear layer whose weight is laid out once for the fastest GEMM on its device.

With the native CPU kernels on (fp32), the weight is packed for kernels/cpu/csrc/linear.c (16-column
blocks streamed k-major; faster than oneDNN for decode-sized batches, equal for prefill; see
there). Otherwise, on x86 CPUs the weight is reordered into oneDNN's blocked format
(``torch.ops.mkldnn._reorder_linear_weight``) and applied with ``_linear_pointwise``: faster
than MKL's sgemm for decode-sized batches (M = 1..32) and for prefill (docs/benchmarks.md),
and it fuses the residual add. Elsewhere (GPU, a
torch without oneDNN, non-fp32) it is plain ``F.linear`` / ``addmm``. Both compute in the
weight's dtype with fp32 accumulation; results differ only in summation order.

A weight still in ggml blocks (:class:`~prefixgate.kernels.quant.QuantizedTensor`, from a GGUF
file) runs natively in its blocks (kernels/cpu/csrc/linear_quant.c: a decode step streams ~96 MB
instead of 540 MB of fp32 for SmolLM2) when ``native`` is set and the kernel is built here;
otherwise it is dequantized once, exactly, and takes the paths above. With ``int8_activations``
(the ``--dtype q8`` mode, docs/precision.md) such a weight is repacked for
kernels/cpu/csrc/linear_q8.c instead: each input row is quantized to int8 per 32 k and the block
products are summed in integers (AVX512-VNNI), output, bias and residual in fp32.

A bf16 weight on CPU (the ``--dtype bf16`` mode, docs/precision.md) takes fp32 activations and
returns fp32: the input is rounded to bf16 for the GEMM only, products are summed in fp32, and
bias and residual stay fp32. Natively (kernels/cpu/csrc/linear_bf16.c: AMX tiles, or
AVX512-BF16 where AMX is absent) that is one call with the epilogue fused; otherwise oneDNN's
bf16 GEMM (or ``F.linear``), whose bf16 output is widened before the fp32 bias and residual.
"""

from __future__ import annotations

import functools
import weakref
from collections.abc import Callable, Hashable, Sequence

import torch
import torch.nn.functional as F

from prefixgate.kernels.cpu.host_memory import HugePageArena
from prefixgate.kernels.cpu.ops import (
    linear_bf16_native,
    linear_native,
    linear_q8_native,
    linear_quant_native,
    pack_bf16_weight,
    pack_linear_weight,
    pack_q8_weight,
    pack_quant_weight,
    q8_rows_native,
    quant_rows_native,
)
from prefixgate.kernels.quant import QuantizedTensor

# oneDNN picks its blocked layout for this many rows; the choice barely matters between 16 and
# 128 rows, and this one also serves 1-row decode and 2048-row prefill best (docs/benchmarks.md)
_PACK_BATCH_HINT = 64


# Layers built over the same source tensors with the same flags, shared by every model built
# over them: packing the quantized blocks is seconds of CPU per model, and a process may build
# several models over one loaded model (benchmarks compare two runners; the test suite builds
# dozens). A packed layer is never written after it is built. Keyed by the sources' ids; an
# entry goes as soon as any of its sources is freed, before its id can be reused.
_SHARED: dict[tuple[Hashable, ...], Linear] = {}


def shared_linear(
    sources: Sequence[object], flags: tuple[Hashable, ...] | None, build: Callable[[], Linear]
) -> Linear:
    """``build()``, or the layer an earlier call built from the same ``sources`` (tensors or
    :class:`QuantizedTensor`, compared by identity) and ``flags``; ``flags`` None: never
    shared. CPU layers only: a device layer is not kept past its model."""
    tensors = [s.data if isinstance(s, QuantizedTensor) else s for s in sources]
    if flags is None or not tensors:
        return build()
    if any(not isinstance(t, torch.Tensor) or t.device.type != "cpu" for t in tensors):
        return build()
    if any(isinstance(f, torch.device) and f.type != "cpu" for f in flags):
        return build()
    key = (*map(id, tensors), *flags)
    layer = _SHARED.get(key)
    if layer is None:
        layer = _SHARED[key] = build()
        for tensor in tensors:
            weakref.finalize(tensor, _SHARED.pop, key, None)
    return layer


@functools.cache
def onednn_linear_available() -> bool:
    """Whether this torch can run oneDNN-packed fp32 linear layers on CPU."""
    if not torch.backends.mkldnn.is_available():
        return False
    try:
        weight = torch.ops.mkldnn._reorder_linear_weight(torch.ones(8, 8), _PACK_BATCH_HINT)
        out = torch.ops.mkldnn._linear_pointwise(torch.ones(2, 8), weight, None, "none", [], "")
    except (RuntimeError, AttributeError):
        return False
    return bool(torch.all(out == 8))


class Linear:
    """``y = x @ weight.T (+ bias)`` for ``x [T, in]``; ``weight [out, in]``.

    Args:
        weight: ``[out_features, in_features]`` on the compute device, in the compute dtype
            (bf16 on CPU: fp32 activations in and out, see above); or ggml blocks (CPU fp32
            compute only), kept as they are with ``native``.
        bias: ``[out_features]`` or None.
        pack: reorder for oneDNN (CPU fp32 / bf16 only; ignored where unavailable).
        native: pack for the native CPU kernel (kernels/cpu/ops.py) when it is available;
            takes precedence over ``pack``.
        arena: where the natively packed weight is allocated (huge pages; see
            kernels/cpu/host_memory.py); None: an ordinary allocation.
        int8_activations: a natively run ggml-block weight multiplies int8-quantized inputs
            (linear_q8.c, the q8 mode) where that kernel is built; other weights ignore it.
    """

    __slots__ = (
        "bf16", "bias", "in_features", "native", "out_features", "packed", "q8", "quant",
        "weight",
    )

    def __init__(
        self,
        weight: torch.Tensor | QuantizedTensor,
        bias: torch.Tensor | None = None,
        *,
        pack: bool = True,
        native: bool = False,
        arena: HugePageArena | None = None,
        int8_activations: bool = False,
    ):
        self.out_features, self.in_features = weight.shape
        self.quant: str | None = None  # the ggml type of a natively packed quantized weight
        # a bf16 weight on CPU: activations enter and leave in fp32 (rounded for the GEMM only)
        self.bf16 = (
            isinstance(weight, torch.Tensor)
            and weight.dtype == torch.bfloat16
            and weight.device.type == "cpu"
        )
        self.native = None
        self.q8 = False  # the block weight's products take int8 activations (linear_q8.c)
        if isinstance(weight, QuantizedTensor):
            if native and int8_activations:
                self.native = pack_q8_weight(weight, arena)
                self.q8 = self.native is not None
            if native and not self.q8:
                self.native = pack_quant_weight(weight, arena)
            if self.native is not None:
                self.quant = weight.qtype
            else:
                weight = weight.dequantize()
        elif native:
            pack_native = pack_bf16_weight if self.bf16 else pack_linear_weight
            self.native = pack_native(weight, arena)
        # the native kernel reads the bias as one dense row
        self.bias = bias.contiguous() if bias is not None and self.native is not None else bias
        use_onednn = (
            self.native is None
            and pack
            and weight.device.type == "cpu"
            and weight.dtype in (torch.float32, torch.bfloat16)
            and onednn_linear_available()
        )
        self.packed = (
            torch.ops.mkldnn._reorder_linear_weight(weight.contiguous(), _PACK_BATCH_HINT)
            if use_onednn
            else None
        )
        # BLAS takes the transposed view as is; no second copy of the weight
        self.weight = None if use_onednn or self.native is not None else weight

    def __call__(self, x: torch.Tensor) -> torch.Tensor:  # [T, in] -> [T, out]
        if self.native is not None:
            return self._native(x, None)
        if self.bf16:
            out = self._bf16_product(x)
            return out if self.bias is None else out + self.bias
        if self.packed is not None:
            return torch.ops.mkldnn._linear_pointwise(x, self.packed, self.bias, "none", [], "")
        return F.linear(x, self.weight, self.bias)

    def add_to(self, x: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        """``residual + x @ weight.T`` (+ bias), the add fused into the GEMM."""
        if self.native is not None:
            return self._native(x, residual)
        if self.bf16:
            out = residual + self._bf16_product(x)
            return out if self.bias is None else out + self.bias
        if self.packed is not None:
            return torch.ops.mkldnn._linear_pointwise.binary(
                x, residual, self.packed, self.bias, "add"
            )
        out = torch.addmm(residual, x, self.weight.t())
        return out if self.bias is None else out + self.bias

    def _bf16_product(self, x: torch.Tensor) -> torch.Tensor:
        """``x @ weight.T`` of a bf16 weight without its native kernel, in ``x``'s dtype."""
        xb = x.to(torch.bfloat16)
        if self.packed is not None:
            out = torch.ops.mkldnn._linear_pointwise(xb, self.packed, None, "none", [], "")
        else:
            out = F.linear(xb, self.weight)
        return out.to(x.dtype)

    def rows(self, ids: torch.Tensor) -> torch.Tensor:
        """``weight[ids]`` (``[T, in]``) of a natively packed quantized weight: the embedding
        lookup from the tied LM head's blocks, so no fp32 table is kept beside them."""
        if self.quant is None:
            raise TypeError("rows(): only for a natively packed quantized weight")
        gather = q8_rows_native if self.q8 else quant_rows_native
        out = gather(ids, self.native, self.quant, (self.out_features, self.in_features))
        if out is None:
            raise ValueError(f"rows(): ids {ids.dtype} on {ids.device} must be 1-D int64 on CPU")
        return out

    def _native(self, x: torch.Tensor, residual: torch.Tensor | None) -> torch.Tensor:
        assert self.native is not None
        out = self._native_once(x, residual)
        if out is None:  # a column stride other than 1: one dense copy, then the same kernel
            x = x.contiguous()
            residual = None if residual is None else residual.contiguous()
            out = self._native_once(x, residual)
        if out is None:
            raise ValueError(
                f"linear: input {tuple(x.shape)} {x.dtype} on {x.device} does not fit the "
                f"[{self.out_features}, {self.in_features}] "
                f"{'bf16' if self.bf16 else 'fp32'} CPU weight (fp32 activations)"
            )
        return out

    def _native_once(self, x: torch.Tensor, residual: torch.Tensor | None) -> torch.Tensor | None:
        if self.q8:
            return linear_q8_native(
                x, self.native, self.quant, self.out_features, self.bias, residual
            )
        if self.quant is not None:
            return linear_quant_native(
                x, self.native, self.quant, self.out_features, self.bias, residual
            )
        if self.bf16:
            return linear_bf16_native(x, self.native, self.out_features, self.bias, residual)
        return linear_native(x, self.native, self.out_features, self.bias, residual)


__all__ = ["Linear", "onednn_linear_available"]
