"""gpt-oss's mixture of experts: a biased router, softmax over the top-k logits, and experts
with biases and a clamped SwiGLU.

    logits = x W_r^T + b_r                      # [T, E]
    top-k logits -> softmax over those k       # the routing weights (not over all E)
    h = x W_gu^T + b_gu;  gate, up = h[:I], h[I:]
    gate = min(gate, limit); up = clamp(up, -limit, limit)
    y = ((up + 1) * gate * sigmoid(alpha * gate)) W_d^T + b_d

HF checkpoints store ``gate_up_proj`` ``[E, H, 2I]`` with gate and up interleaved column by
column; models/gpt_oss.py rewrites it at load into the stacked ``[E, I, H]`` gate / up /
``[E, H, I]`` down matrices every MoE family here uses (plus ``*.bias`` tensors), so this
module sees the usual layout (gate rows first). Each expert is two linear layers of the
weight placer (models/weights.py: the native CPU GEMM with its bias fused on the native path),
and only the chosen experts run, each once over all the step's tokens routed to it. MXFP4
experts (gpt-oss's released checkpoints) stay in their blocks: each expert is a pair of
``Mxfp4Linear`` layers (kernels/cpu/mxfp4.py: the native MXFP4 kernel on CPU, fp32 activations).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.nn.functional as F

from prefixgate.kernels.layer_ops import (
    Mxfp4Experts,
    Mxfp4Linear,
    Mxfp4Tensor,
    grouped_by_expert,
)

# x [n, in] -> [n, out] (+ bias): a models/linear.py Linear
Projection = Callable[[torch.Tensor], torch.Tensor]


class GptOssMoE:
    """Args:
    router / router_bias: ``[E, H]`` / ``[E]``.
    experts: per expert ``(gate_up, down)`` with their biases: ``H -> 2I`` (gate rows first)
        and ``I -> H``.
    top_k; alpha, limit: the clamped SwiGLU's constants (1.702, 7.0 in gpt-oss).
    """

    def __init__(self, router: torch.Tensor, router_bias: torch.Tensor,
                 experts: Sequence[tuple[Projection, Projection]], *,
                 top_k: int, alpha: float, limit: float) -> None:
        self.router, self.router_bias = router, router_bias
        self.experts = list(experts)
        self.top_k, self.alpha, self.limit = top_k, alpha, limit
        self.num_experts = router.shape[0]

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Top-k ``(weights [T, k], experts [T, k] int64)``: softmax over the k logits."""
        logits = F.linear(x, self.router, self.router_bias)  # [T, E]
        top, experts = logits.topk(self.top_k, dim=-1)
        return top.softmax(-1), experts

    def _expert(self, expert: int, x: torch.Tensor) -> torch.Tensor:  # [n, H] -> [n, H]
        gate_up, down = self.experts[expert]
        hidden = gate_up(x)  # [n, 2I]
        inter = hidden.shape[1] // 2
        gate = hidden[:, :inter].clamp(max=self.limit)
        up = hidden[:, inter:].clamp(-self.limit, self.limit)
        return down((up + 1) * (gate * torch.sigmoid(gate * self.alpha)))

    def __call__(self, x: torch.Tensor) -> torch.Tensor:  # [T, H] -> [T, H]
        weights, experts = self.route(x)
        return grouped_by_expert(x, weights, experts, self.num_experts, self._expert)

    def add_to(self, x: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        return residual + self(x)


def load_gpt_oss_moe(place: Any, prefix: str, *, top_k: int, alpha: float,
                     limit: float) -> GptOssMoE:
    """The layer's experts from the canonical names, each a pair of the placer's linear layers
    (``place``: models/weights.py's WeightPlacer), or of MXFP4 layers where the experts are in
    MXFP4 blocks (kernels/cpu/mxfp4.py)."""
    names = [f"{prefix}experts.{part}_proj" for part in ("gate", "up", "down")]
    gate_bias, up_bias, down_bias = (place.weights[n + ".bias"] for n in names)
    if isinstance(place.weights[names[0] + ".weight"], Mxfp4Experts):
        gates, ups, downs = (place.weights[n + ".weight"] for n in names)
        experts = [
            (_mxfp4_linear(place, [gate, up], torch.cat([gate_bias[e], up_bias[e]])),
             _mxfp4_linear(place, [down], down_bias[e]))
            for e, (gate, up, down) in enumerate(zip(gates, ups, downs, strict=True))
        ]  # fmt: skip
    else:
        gates, ups, downs = (place.expert_parts(n + ".weight") for n in names)
        experts = [
            (place.linear([gate, up], [gate_bias[e], up_bias[e]]),
             place.linear([down], [down_bias[e]]))
            for e, (gate, up, down) in enumerate(zip(gates, ups, downs, strict=True))
        ]  # fmt: skip
    return GptOssMoE(place.tensor(prefix + "gate.weight"), place.tensor(prefix + "gate.bias"),
                     experts, top_k=top_k, alpha=alpha, limit=limit)


def _mxfp4_linear(place: Any, parts: list[Mxfp4Tensor], bias: torch.Tensor) -> Mxfp4Linear:
    """One expert layer kept in MXFP4 (gate | up as two parts, never copied together): the
    native kernel where the placer runs native CPU kernels, else the torch reference (CPU) or
    the matrices expanded once (another device)."""
    return Mxfp4Linear(parts, bias, native=place.native, device=place.device, dtype=place.dtype)


__all__ = ["GptOssMoE", "load_gpt_oss_moe"]
