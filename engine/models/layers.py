"""The pieces every decoder layer is made of: RMSNorm, the gated MLP, the activation dtype.

Flat layout: ``[num_tokens, hidden]`` for the whole step. Which implementation each piece runs
(the fused native ops of kernels/cpu/ on CPU in fp32 where the library builds, torch ops
otherwise, with the same math) is chosen once at load by the kernel registry
(kernels/layer_ops.py): a layer holds the bound op.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import torch

from prefixgate.engine.models.linear import Linear
from prefixgate.kernels.layer_ops import rms_norm


def activation_dtype(device: torch.device, dtype: torch.dtype) -> torch.dtype:
    """What activations are computed in for a model of ``dtype`` on ``device``: ``dtype`` itself,
    except bf16 on CPU, whose activations stay fp32 (only the GEMMs' inputs are bf16: a bf16
    residual stream would round every layer's sum, and the fused CPU ops are fp32)."""
    if device.type == "cpu" and dtype == torch.bfloat16:
        return torch.float32
    return dtype


class DenseMLP(NamedTuple):
    """``down(act(gate) * up)``: SwiGLU (``silu``) or Gemma's GeGLU (``gelu_tanh``); ``act`` is
    the registry's gated activation (``LayerOps.gated_activation``), bound at load."""

    gate_up: Linear  # H -> 2I (gate rows first)
    down: Linear  # I -> H
    act: Callable[[torch.Tensor], torch.Tensor]  # [T, 2I] -> [T, I]

    def __call__(self, x: torch.Tensor) -> torch.Tensor:  # [T, H] -> [T, H]
        return self.down(self.act(self.gate_up(x)))

    def add_to(self, x: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        """``residual + mlp(x)``, the add fused into the down projection."""
        return self.down.add_to(self.act(self.gate_up(x)), residual)


__all__ = ["DenseMLP", "activation_dtype", "rms_norm"]
