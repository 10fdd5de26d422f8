"""The kernel registry of a model's layers: each layer's op is picked once, at load.

A model asks this registry, never a backend folder, for what its layers compute with:

    ops = LayerOps(KernelChoice(backend, native=True), device, act_dtype)   # once per model
    norm = ops.rms_norm(weight, eps)         # [T, H] -> [T, H]
    act = ops.gated_activation("silu")       # [T, 2I] (gate first) -> [T, I]
    rope = ops.rope(head_dim, rotary_dim)    # (x [T, H, D], cos, sin [T, 1, R/2]) -> rotated x
    proj = ops.linear(weight, bias)          # a LinearOp: proj(x), proj.add_to(x, residual)
    ops.moe_experts(), ops.gated_delta()     # the backend's grouped experts, linear attention

Each returns a callable bound to its weight and implementation. The choice happens here: the
native CPU kernels (kernels/cpu/) where the runner asked for them (``native``), the library built,
the device is the CPU and the activations fp32, and the weight is one they take; the torch forms
(here and kernels/torch_cpu/) otherwise. Nothing is re-decided per call: the bound native ops
check nothing the load knew (see each op for what its caller guarantees). What only a call can
know is decided there, in one documented branch each: a linear's input with a column stride
other than 1 is copied dense first, an empty batch skips the kernel, and the quantized linear
takes its AMX kernel from 12 rows (kernels/cpu/linear_quant.py).

Linear layers by weight form (:func:`bind_linear`):

=============================  ==================  =========================================
weight                          native (CPU, fp32)  otherwise
=============================  ==================  =========================================
fp32 tensor                    linear.c             oneDNN blocked (x86), else ``F.linear``
bf16 tensor (``--dtype bf16``) linear_bf16.c        oneDNN / ``F.linear`` in bf16, fp32 around
ggml blocks (GGUF Q4/Q8)       linear_quant.c       dequantized once, then as fp32
ggml blocks, ``int8``          linear_q8.c          (the q8 mode needs the native kernel)
=============================  ==================  =========================================
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple, Protocol

import torch
import torch.nn.functional as F

from prefixgate.kernels import dispatch
from prefixgate.kernels.cpu.decode_step import (
    DenseDecodeStep,
    DenseLayerOps,
    bind_dense_decode_step,
)
from prefixgate.kernels.cpu.host_memory import HugePageArena
from prefixgate.kernels.cpu.library import library
from prefixgate.kernels.cpu.linear import NativeLinear, NativeLinearF32, pack_linear_weight
from prefixgate.kernels.cpu.linear_bf16 import NativeLinearBF16, pack_bf16_weight
from prefixgate.kernels.cpu.linear_quant import (
    NativeLinearQ8,
    NativeLinearQuant,
    pack_q8_weight,
    pack_quant_weight,
    quant_native_available,
)
from prefixgate.kernels.cpu.mxfp4 import Mxfp4Linear
from prefixgate.kernels.cpu.ops import NativeHeadNorm, NativeRMSNorm, NativeRope, NativeSiluMul
from prefixgate.kernels.quant import QuantizedTensor
from prefixgate.kernels.torch_cpu.linear import (
    BF16Linear,
    OneDNNLinear,
    TorchLinear,
    onednn_linear_available,
    onednn_pack,
)
from prefixgate.kernels.torch_cpu.moe import grouped_by_expert
from prefixgate.kernels.torch_cpu.mxfp4 import Mxfp4Experts, Mxfp4Tensor, cat_rows_mxfp4

Op = Callable[[torch.Tensor], torch.Tensor]


class LinearOp(Protocol):
    """``y = x @ W.T (+ bias)`` for ``x [T, in]``, bound to one weight at load."""

    def __call__(self, x: torch.Tensor) -> torch.Tensor: ...

    def add_to(self, x: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        """``residual + x @ W.T (+ bias)`` (fused into the GEMM where the kernel can)."""
        ...


@dataclass(frozen=True, slots=True)
class KernelChoice:
    """What the runner chose for a model's kernels, once at start-up.

    Args:
        backend: the resolved kernel backend name (``kernels.resolve_backend``): attention,
            the grouped MoE experts and linear attention; None: the per-expert layers.
        native: run the layers on the native CPU kernels where they build (CPU, fp32
            activations): norm, activation, RoPE, the linear layers, the K/V write.
        quantized_weights: with ``native``, ggml-block matrices stay in their blocks.
        int8_activations: the q8 mode: those block matrices take int8-quantized inputs.
        whole_step: with ``native``, a dense model's small steps run every layer in one
            native call (:meth:`LayerOps.dense_decode_step`).
    """

    backend: str | None = None
    native: bool = False
    quantized_weights: bool = True
    int8_activations: bool = False
    whole_step: bool = True


# ---- the torch forms (any device; the oracle of the native ops in the tests) ----------


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """``weight * x / rms(x)`` over the last dim, computed in fp32 (as the reference does)."""
    dtype = x.dtype
    x32 = x.float()
    x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return weight * x32.to(dtype)


def rotate_half(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate ``x [T, H, D]`` (any strides) by the angles in ``cos``/``sin [T, 1, D/2]``.

    Pair i is (x[i], x[i + D/2]) (HF's rotate-half). Returns a new contiguous tensor.
    """
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half], x[..., half:]
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)


class _TorchNorm:
    __slots__ = ("eps", "weight")

    def __init__(self, weight: torch.Tensor, eps: float) -> None:
        self.weight, self.eps = weight, eps

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, self.weight, self.eps)


def _silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    inter = gate_up.shape[1] // 2
    return F.silu(gate_up[:, :inter]) * gate_up[:, inter:]


def _gelu_tanh_mul(gate_up: torch.Tensor) -> torch.Tensor:
    inter = gate_up.shape[1] // 2
    return F.gelu(gate_up[:, :inter], approximate="tanh") * gate_up[:, inter:]


_ACTIVATIONS: dict[str, Op] = {"silu": _silu_mul, "gelu_tanh": _gelu_tanh_mul}


class _PartialRope:
    """The first ``rotary`` dims of each head turn, the rest pass through (Phi-4-mini, Qwen3.5)."""

    __slots__ = ("rotary",)

    def __init__(self, rotary: int) -> None:
        self.rotary = rotary

    def __call__(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        r = self.rotary
        return torch.cat((rotate_half(x[..., :r], cos, sin), x[..., r:]), -1)


def _rope_torch(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    return rotate_half(x, cos, sin)


# ---- the linear layer -----------------------------------------------------------------


def bind_linear(
    weight: torch.Tensor | QuantizedTensor,
    bias: torch.Tensor | None = None,
    *,
    native: bool = False,
    pack: bool = True,
    int8_activations: bool = False,
    arena: HugePageArena | None = None,
) -> LinearOp:
    """The op of one linear layer, its weight laid out once for the implementation chosen here
    (the table above). ``native``: try the native kernel first (it packs into ``arena``);
    ``pack``: oneDNN's layout where no native kernel took the weight; ``int8_activations``: a
    ggml-block weight takes the q8 kernel where it is built (else the weight-only one)."""
    out_features, in_features = weight.shape
    if isinstance(weight, QuantizedTensor):
        if native and int8_activations:
            packed = pack_q8_weight(weight, arena)
            if packed is not None:
                return NativeLinearQ8(packed, bias, weight.qtype, out_features, in_features)
        packed = pack_quant_weight(weight, arena) if native else None
        if packed is not None:
            return NativeLinearQuant(packed, bias, weight.qtype, out_features, in_features)
        weight = weight.dequantize()
    elif native:
        bf16 = weight.dtype == torch.bfloat16 and weight.device.type == "cpu"
        packed = (pack_bf16_weight if bf16 else pack_linear_weight)(weight, arena)
        if packed is not None:
            kind = NativeLinearBF16 if bf16 else NativeLinearF32
            return kind(packed, bias, out_features, in_features)
    return _torch_linear(weight, bias, pack)


def _torch_linear(weight: torch.Tensor, bias: torch.Tensor | None, pack: bool) -> LinearOp:
    cpu = weight.device.type == "cpu"
    onednn = (pack and cpu and weight.dtype in (torch.float32, torch.bfloat16)
              and onednn_linear_available())
    packed = onednn_pack(weight) if onednn else None
    if cpu and weight.dtype == torch.bfloat16:  # fp32 activations in and out
        return BF16Linear(None if onednn else weight, packed, bias)
    if packed is not None:
        return OneDNNLinear(packed, bias)
    return TorchLinear(weight, bias)


# ---- the registry of one model --------------------------------------------------------


class LayerOps:
    """The ops of one model's layers, chosen from ``choice`` for ``device`` and activations in
    ``act_dtype`` (built once at load; the model binds every layer through it).

    Attributes:
        choice: what the runner asked for.
        native_linear: linear layers try the native kernels (``native`` on a CPU).
        native: the fused native ops (norm, activation, RoPE) run: ``native_linear``, fp32
            activations and the library built here.
        quantized: ggml blocks stay blocks (``quantized_weights``, the weight-only kernel built
            here, fp32 compute: ``dtype``).
    """

    def __init__(self, choice: KernelChoice, device: torch.device, act_dtype: torch.dtype,
                 dtype: torch.dtype | None = None) -> None:
        self.choice = choice
        self.native_linear = choice.native and device.type == "cpu"
        self.native = (self.native_linear and act_dtype == torch.float32
                       and library() is not None)
        self.quantized = (choice.quantized_weights and self.native_linear
                          and (dtype or act_dtype) == torch.float32 and quant_native_available())
        self.int8_activations = choice.int8_activations and self.quantized

    def rms_norm(self, weight: torch.Tensor, eps: float) -> Op:
        """``x [T, H] -> weight * x / rms(x)``: native for an fp32 CPU weight ``[H]``; its
        callers pass 2-D rows with a unit column stride (see ``NativeRMSNorm``)."""
        fits = weight.dim() == 1 and weight.dtype == torch.float32 and weight.device.type == "cpu"
        return NativeRMSNorm(weight, eps) if self.native and fits else _TorchNorm(weight, eps)

    def head_norm(self, q_weight: torch.Tensor, k_weight: torch.Tensor, eps: float,
                  num_heads: int, num_kv_heads: int) -> Op:
        """Per-head RMSNorm of ``qk [T, Hq + Hkv, D]``, q heads with ``q_weight``, k heads with
        ``k_weight`` (``[D]`` each): natively in place (dense heads, rows at any stride), else
        the torch form over one ``[Hq + Hkv, D]`` weight (a new tensor)."""
        fits = all(w.dim() == 1 and w.dtype == torch.float32 and w.device.type == "cpu"
                   for w in (q_weight, k_weight))
        if self.native and fits:
            return NativeHeadNorm(q_weight, k_weight, eps, num_heads, num_kv_heads)
        weight = torch.cat([q_weight.expand(num_heads, -1), k_weight.expand(num_kv_heads, -1)])
        return _TorchNorm(weight, eps)

    def gated_activation(self, activation: str) -> Op:
        """``gate_up [T, 2I] -> act(gate) * up`` for ``"silu"`` (native where it runs) or
        ``"gelu_tanh"``."""
        if activation == "silu" and self.native:
            return NativeSiluMul()
        return _ACTIVATIONS[activation]

    def rope(self, head_dim: int, rotary_dim: int | None = None) -> Callable[..., torch.Tensor]:
        """``(x [T, H, D], cos, sin [T, 1, R/2]) -> rotated x``: in place natively (full
        rotary, an even head size), else a new tensor; ``rotary_dim`` < ``head_dim``: only
        the first ``rotary_dim`` dims turn."""
        if rotary_dim is not None and rotary_dim != head_dim:
            return _PartialRope(rotary_dim)
        if self.native and head_dim % 2 == 0:
            return NativeRope(head_dim)
        return _rope_torch

    def linear(self, weight: torch.Tensor | QuantizedTensor, bias: torch.Tensor | None = None,
               arena: HugePageArena | None = None) -> LinearOp:
        """One linear layer (:func:`bind_linear` with this model's choice)."""
        return bind_linear(weight, bias, native=self.native_linear,
                           int8_activations=self.int8_activations, arena=arena)

    def weight_arena(self) -> HugePageArena | None:
        """Where natively packed weights go (huge pages, in the order a step reads them)."""
        return HugePageArena() if self.native_linear else None

    def moe_experts(self) -> Callable[..., torch.Tensor] | None:
        """The backend's grouped experts op (``kernels.moe_experts_op``), or None where the
        model runs one native linear layer per expert instead (or names no backend)."""
        backend = self.choice.backend
        return None if backend is None or self.native_linear else dispatch.moe_experts_op(backend)

    def dense_decode_step(self, layers: Sequence[DenseLayerOps], rope: object | None,
                          **shape: Any) -> DenseDecodeStep | None:
        """Every layer of a decode step in one native call (kernels/cpu/decode_step.py:
        bit-identical to running the layers' ops one by one), where each op of each layer is
        one it runs; None otherwise, and where the runner asked for the per-op path
        (``KernelChoice.whole_step``: ``--native-decode-step off``). ``shape``: ``hidden``,
        ``num_heads``, ``num_kv_heads``, ``head_dim``, ``eps``, ``scale``."""
        if not self.native or not self.choice.whole_step:
            return None
        return bind_dense_decode_step(layers, rope, **shape)

    def gated_delta(self) -> Any:
        """A hybrid model's linear-attention ops (``kernels.gated_delta_ops``)."""
        return dispatch.gated_delta_ops(self.choice.backend or "torch", self.choice.native)


class LinearForm(NamedTuple):
    """What :func:`bind_linear` chose for a weight (for reports and tests)."""

    native: torch.Tensor | None  # the natively packed weight
    packed: torch.Tensor | None  # oneDNN's blocked weight
    weight: torch.Tensor | None  # the plain weight F.linear reads
    quant: str | None  # the ggml type of a weight kept in blocks
    q8: bool  # int8 activations (linear_q8.c)
    bf16: bool  # a bf16 weight on CPU (fp32 activations in and out)
    bias: torch.Tensor | None


def linear_form(op: LinearOp) -> LinearForm:
    """The weight form and kernel of a bound linear op."""
    if isinstance(op, NativeLinear):
        packed, bias = op.data
        quant = op.qtype if isinstance(op, NativeLinearQuant | NativeLinearQ8) else None
        return LinearForm(packed, None, None, quant, isinstance(op, NativeLinearQ8),
                          isinstance(op, NativeLinearBF16), bias)
    if isinstance(op, BF16Linear):
        return LinearForm(None, op.packed, op.weight, None, False, True, op.bias)
    if isinstance(op, OneDNNLinear):
        return LinearForm(None, op.packed, None, None, False, False, op.bias)
    assert isinstance(op, TorchLinear)
    return LinearForm(None, None, op.weight, None, False, False, op.bias)


__all__ = [
    "DenseDecodeStep",
    "DenseLayerOps",
    "KernelChoice",
    "LayerOps",
    "LinearOp",
    "HugePageArena",
    "LinearForm",
    "Mxfp4Experts",
    "Mxfp4Linear",
    "Mxfp4Tensor",
    "bind_linear",
    "cat_rows_mxfp4",
    "grouped_by_expert",
    "linear_form",
    "onednn_linear_available",
    "rms_norm",
    "rotate_half",
]
