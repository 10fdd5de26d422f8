"""A linear layer whose weight is laid out once, at load, for the GEMM the kernel registry
picks for it (kernels/layer_ops.py, ``bind_linear``: the table of weight forms and kernels).

fp32 weights run on the native CPU kernel (kernels/cpu/csrc/linear.c) with the native ops on,
else oneDNN's blocked layout on x86 CPUs, else ``F.linear``. A weight still in ggml blocks (a
GGUF's Q4_0/Q4_1/Q8_0) runs natively in its blocks (linear_quant.c: a decode step streams
~96 MB instead of 540 MB of fp32 for SmolLM2), or with ``int8_activations`` (the ``--dtype q8``
mode, docs/precision.md) on int8-quantized inputs (linear_q8.c); elsewhere it is dequantized
once, exactly. A bf16 weight on CPU (the ``--dtype bf16`` mode) takes fp32 activations and
returns fp32: the input is rounded to bf16 for the GEMM only (linear_bf16.c natively, else
oneDNN's bf16 GEMM or ``F.linear``, widened before the fp32 bias and residual).

:class:`Linear` holds the bound op and forwards each call to it: nothing is chosen per call.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Hashable, Sequence

import torch

from prefixgate.kernels.layer_ops import (
    HugePageArena,
    LinearOp,
    bind_linear,
    linear_form,
    onednn_linear_available,
)
from prefixgate.kernels.quant import QuantizedTensor

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


class Linear:
    """``y = x @ weight.T (+ bias)`` for ``x [T, in]``; ``weight [out, in]``.

    Args:
        weight: ``[out_features, in_features]`` on the compute device, in the compute dtype
            (bf16 on CPU: fp32 activations in and out, see above); or ggml blocks (CPU fp32
            compute only), kept as they are with ``native``.
        bias: ``[out_features]`` or None.
        pack: reorder for oneDNN (CPU fp32 / bf16 only; ignored where unavailable).
        native: the native CPU kernel where it takes the weight; takes precedence over ``pack``.
        arena: where the natively packed weight is allocated (huge pages; see
            kernels/cpu/host_memory.py); None: an ordinary allocation.
        int8_activations: a natively run ggml-block weight multiplies int8-quantized inputs
            (linear_q8.c, the q8 mode) where that kernel is built; other weights ignore it.

    Attributes (what the registry chose, for reports and tests): ``native`` the natively
    packed weight or None, ``packed`` oneDNN's or None, ``weight`` the plain one or None,
    ``quant`` the ggml type kept in blocks, ``q8`` int8 activations, ``bf16`` a bf16 weight.
    """

    __slots__ = (
        "_op", "bf16", "bias", "in_features", "native", "out_features", "packed", "q8", "quant",
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
        self._op: LinearOp = bind_linear(weight, bias, native=native, pack=pack,
                                         int8_activations=int8_activations, arena=arena)
        form = linear_form(self._op)
        self.native, self.packed, self.weight = form.native, form.packed, form.weight
        self.quant, self.q8, self.bf16 = form.quant, form.q8, form.bf16
        self.bias = form.bias if form.native is not None else bias

    @property
    def op(self) -> LinearOp:
        """The op the registry bound (what a whole-step binding reads)."""
        return self._op

    def __call__(self, x: torch.Tensor) -> torch.Tensor:  # [T, in] -> [T, out]
        return self._op(x)

    def add_to(self, x: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        """``residual + x @ weight.T`` (+ bias), the add fused into the GEMM."""
        return self._op.add_to(x, residual)

    def rows(self, ids: torch.Tensor) -> torch.Tensor:
        """``weight[ids]`` (``[T, in]``) of a natively packed quantized weight: the embedding
        lookup from the tied LM head's blocks, so no fp32 table is kept beside them."""
        rows = getattr(self._op, "rows", None)
        if rows is None:
            raise TypeError("rows(): only for a natively packed quantized weight")
        return rows(ids)


__all__ = ["Linear", "onednn_linear_available", "shared_linear"]
