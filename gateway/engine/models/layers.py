"""The pieces every decoder layer is made of: RMSNorm, the gated MLP, the activation dtype.

Flat layout: ``[num_tokens, hidden]`` for the whole step. On CPU in fp32 (``native``) the norm
and SiLU-and-multiply run as fused native ops (kernels/cpu/ops.py) where the library builds;
each falls back to its torch ops otherwise, with the same math.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn.functional as F

from prefixgate.gateway.engine.models.linear import Linear
from prefixgate.kernels.cpu.ops import rms_norm_native, silu_mul_native


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, native: bool = False) -> torch.Tensor:
    """``weight * x / rms(x)`` over the last dim, computed in fp32 (as the reference does).

    ``native``: fp32 CPU rows go through one fused native pass when it is available.
    """
    if native:
        out = rms_norm_native(x, weight, eps)
        if out is not None:
            return out
    dtype = x.dtype
    x32 = x.float()
    x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return weight * x32.to(dtype)


def activation_dtype(device: torch.device, dtype: torch.dtype) -> torch.dtype:
    """What activations are computed in for a model of ``dtype`` on ``device``: ``dtype`` itself,
    except bf16 on CPU, whose activations stay fp32 (only the GEMMs' inputs are bf16: a bf16
    residual stream would round every layer's sum, and the fused CPU ops are fp32)."""
    if device.type == "cpu" and dtype == torch.bfloat16:
        return torch.float32
    return dtype


class DenseMLP(NamedTuple):
    """``down(act(gate) * up)``: SwiGLU (``silu``) or Gemma's GeGLU (``gelu_tanh``)."""

    gate_up: Linear  # H -> 2I (gate rows first)
    down: Linear  # I -> H
    activation: str  # "silu" or "gelu_tanh"
    native: bool = False  # fused native SiLU-and-multiply (CPU fp32)

    def _hidden(self, x: torch.Tensor) -> torch.Tensor:  # [T, H] -> [T, I]
        gate_up = self.gate_up(x)  # [T, 2I]
        if self.native and self.activation == "silu":
            act = silu_mul_native(gate_up)
            if act is not None:
                return act
        inter = gate_up.shape[1] // 2
        gate = gate_up[:, :inter]
        act = F.silu(gate) if self.activation == "silu" else F.gelu(gate, approximate="tanh")
        return act * gate_up[:, inter:]

    def __call__(self, x: torch.Tensor) -> torch.Tensor:  # [T, H] -> [T, H]
        return self.down(self._hidden(x))

    def add_to(self, x: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        """``residual + mlp(x)``, the add fused into the down projection."""
        return self.down.add_to(self._hidden(x), residual)


__all__ = ["DenseMLP", "activation_dtype", "rms_norm"]
