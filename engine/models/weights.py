"""Loaded weights placed on the device in the form the forward pass reads, once, at load.

Matrices are stacked by rows where one GEMM serves several projections (q|k|v, gate|up) and
packed for the device's fastest GEMM (models/linear.py). ggml-block matrices (GGUF Q4_0/Q4_1/
Q8_0) stay in their blocks where the native kernel computes them (CPU fp32 with the native ops);
anywhere else they are dequantized here, exactly. Norms, biases and the router stay in the
activation dtype (fp32 in the CPU bf16 mode, see ``activation_dtype``).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch

from prefixgate.engine.models.linear import Linear, shared_linear
from prefixgate.engine.models.moe import StackedExperts
from prefixgate.kernels.layer_ops import LayerOps
from prefixgate.kernels.quant import QuantizedTensor, cat_rows

Weight = torch.Tensor | QuantizedTensor


class WeightPlacer:
    """Reads HF-named weights and puts them on ``device``.

    Args:
        weights: HF-named tensors, fp32 or ggml blocks (see ``LoadedModel``); read, not kept.
        device / dtype: where and in what precision the matrices compute.
        act_dtype: the activations' dtype (norms, biases, the router).
        ops: the model's kernel registry (kernels/layer_ops.py): which kernels the linear
            layers run on, whether ggml blocks stay blocks (``ops.quantized``) and take int8
            inputs (the q8 mode; ``int8_layers`` counts the layers that do).
        norm_weight_offset: added to every norm weight (Gemma scales by ``1 + w``).
    """

    def __init__(
        self,
        weights: Mapping[str, torch.Tensor],
        *,
        device: torch.device,
        dtype: torch.dtype,
        act_dtype: torch.dtype,
        ops: LayerOps,
        norm_weight_offset: float = 0.0,
    ) -> None:
        self.weights = weights
        self.device, self.dtype, self.act_dtype = device, dtype, act_dtype
        self.ops = ops
        self.native = ops.native_linear
        self.quantized = ops.quantized
        self.int8_activations = ops.int8_activations
        self.int8_layers = 0
        self.norm_weight_offset = norm_weight_offset
        # packed native weights sit in huge pages, in the order a step reads them
        self.arena = ops.weight_arena()

    def place(self, tensor: Weight | StackedExperts, to: torch.dtype | None = None) -> torch.Tensor:
        """``tensor`` dequantized, on the device, in ``to`` (default: the activation dtype)."""
        if isinstance(tensor, QuantizedTensor | StackedExperts):
            tensor = tensor.dequantize()
        return tensor.to(device=self.device, dtype=to or self.act_dtype).contiguous()

    def tensor(self, name: str) -> torch.Tensor:
        return self.place(self.weights[name])

    def norm(self, name: str) -> torch.Tensor:
        weight = self.weights[name]
        if self.norm_weight_offset:  # folded in once here, in fp32 as the reference does
            weight = weight.float() + self.norm_weight_offset
        return self.place(weight)

    def matrix(self, parts: Sequence[Weight]) -> Weight:
        """The parts stacked by rows (fused q|k|v, gate|up), in blocks when they can be."""
        first = parts[0]
        if self.quantized and all(
            isinstance(t, QuantizedTensor) and t.qtype == first.qtype for t in parts
        ):
            return first if len(parts) == 1 else cat_rows(list(parts))  # type: ignore[arg-type]
        if len(parts) == 1:
            return self.place(first, self.dtype)
        return torch.cat([self.place(t, self.dtype) for t in parts])

    def linear(self, parts: Sequence[Weight], bias_parts: Sequence[torch.Tensor] = ()) -> Linear:
        """One linear layer over the stacked ``parts`` (+ the stacked biases)."""

        def build() -> Linear:
            bias = self.place(torch.cat(list(bias_parts))) if bias_parts else None
            return Linear(self.matrix(parts), bias, native=self.native, arena=self.arena,
                          int8_activations=self.int8_activations)

        # fp32 layers are not shared (None): hundreds of MB each would stay alive
        flags = (
            (self.device, self.dtype, self.native, self.int8_activations)
            if self.quantized else None
        )  # fmt: skip
        layer = shared_linear([*parts, *bias_parts], flags, build)
        self.int8_layers += layer.q8
        return layer

    def named_linear(self, names: Sequence[str], bias_names: Sequence[str] = ()) -> Linear:
        return self.linear([self.weights[n] for n in names], [self.weights[n] for n in bias_names])

    def expert_parts(self, name: str) -> list[Weight]:
        """Per expert, its matrix of the stacked ``[E, rows, cols]`` weight ``name``."""
        stacked = self.weights[name]  # in blocks per expert, or a tensor
        return list(stacked.parts) if isinstance(stacked, StackedExperts) else list(stacked)


__all__ = ["WeightPlacer"]
