"""The linear layers of the torch backend, one class per weight form, chosen at load
(kernels/layer_ops.py) where no native kernel takes the weight.

* :class:`OneDNNLinear`: on x86 CPUs the weight reordered once into oneDNN's blocked format
  (``torch.ops.mkldnn._reorder_linear_weight``) and applied with ``_linear_pointwise``: faster
  than MKL's sgemm for decode-sized batches (M = 1..32) and for prefill (docs/benchmarks.md),
  and it fuses the residual add.
* :class:`TorchLinear`: plain ``F.linear`` / ``addmm`` (GPU, a torch without oneDNN, other
  dtypes). Both compute in the weight's dtype with fp32 accumulation.
* :class:`BF16Linear`: a bf16 weight on CPU without its native kernel (the ``--dtype bf16``
  mode): fp32 in, rounded to bf16 for the GEMM (oneDNN's, or ``F.linear``), whose bf16 output is
  widened before the fp32 bias and residual.

Each takes ``x [T, in]`` and returns ``[T, out]``; ``add_to(x, residual)`` adds ``residual``.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F

# oneDNN picks its blocked layout for this many rows; the choice barely matters between 16 and
# 128 rows, and this one also serves 1-row decode and 2048-row prefill best (docs/benchmarks.md)
PACK_BATCH_HINT = 64


@functools.cache
def onednn_linear_available() -> bool:
    """Whether this torch can run oneDNN-packed fp32 linear layers on CPU."""
    if not torch.backends.mkldnn.is_available():
        return False
    try:
        weight = torch.ops.mkldnn._reorder_linear_weight(torch.ones(8, 8), PACK_BATCH_HINT)
        out = torch.ops.mkldnn._linear_pointwise(torch.ones(2, 8), weight, None, "none", [], "")
    except (RuntimeError, AttributeError):
        return False
    return bool(torch.all(out == 8))


def onednn_pack(weight: torch.Tensor) -> torch.Tensor:
    """``weight [N, K]`` (fp32 or bf16, CPU) in oneDNN's blocked layout."""
    return torch.ops.mkldnn._reorder_linear_weight(weight.contiguous(), PACK_BATCH_HINT)


class OneDNNLinear:
    """An fp32 weight in oneDNN's blocked layout (:func:`onednn_pack`)."""

    __slots__ = ("bias", "packed")

    def __init__(self, packed: torch.Tensor, bias: torch.Tensor | None) -> None:
        self.packed, self.bias = packed, bias

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.mkldnn._linear_pointwise(x, self.packed, self.bias, "none", [], "")

    def add_to(self, x: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        return torch.ops.mkldnn._linear_pointwise.binary(x, residual, self.packed, self.bias,
                                                         "add")


class TorchLinear:
    """A plain weight: ``F.linear`` (BLAS takes the transposed view as is, no second copy)."""

    __slots__ = ("bias", "weight")

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
        self.weight, self.bias = weight, bias

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight, self.bias)

    def add_to(self, x: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        out = torch.addmm(residual, x, self.weight.t())
        return out if self.bias is None else out + self.bias


def _pointwise_no_bias(x: torch.Tensor, packed: torch.Tensor) -> torch.Tensor:
    return torch.ops.mkldnn._linear_pointwise(x, packed, None, "none", [], "")


class BF16Linear:
    """A bf16 weight on CPU without the native kernel: ``packed`` (oneDNN) or ``weight``
    (``F.linear``), the GEMM chosen here, once."""

    __slots__ = ("_gemm", "bias", "packed", "weight")

    def __init__(self, weight: torch.Tensor | None, packed: torch.Tensor | None,
                 bias: torch.Tensor | None) -> None:
        self.weight, self.packed, self.bias = weight, packed, bias
        if packed is not None:
            self._gemm = functools.partial(_pointwise_no_bias, packed=packed)
        else:
            self._gemm = functools.partial(F.linear, weight=weight)

    def _product(self, x: torch.Tensor) -> torch.Tensor:
        """``x @ weight.T`` in ``x``'s dtype (the inputs rounded to bf16 for the GEMM)."""
        return self._gemm(x.to(torch.bfloat16)).to(x.dtype)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        out = self._product(x)
        return out if self.bias is None else out + self.bias

    def add_to(self, x: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        out = residual + self._product(x)
        return out if self.bias is None else out + self.bias


__all__ = ["BF16Linear", "OneDNNLinear", "TorchLinear", "onednn_linear_available", "onednn_pack"]
