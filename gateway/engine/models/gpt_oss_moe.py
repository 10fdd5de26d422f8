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
module sees the usual layout (gate rows first).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F

from prefixgate.kernels.torch_cpu.moe import grouped_by_expert


class GptOssMoE:
    """Args:
    router / router_bias: ``[E, H]`` / ``[E]``.
    gate_up / gate_up_bias: ``[E, 2I, H]`` (gate rows first) / ``[E, 2I]``.
    down / down_bias: ``[E, H, I]`` / ``[E, H]``.
    top_k; alpha, limit: the clamped SwiGLU's constants (1.702, 7.0 in gpt-oss).
    """

    def __init__(self, router: torch.Tensor, router_bias: torch.Tensor, gate_up: torch.Tensor,
                 gate_up_bias: torch.Tensor, down: torch.Tensor, down_bias: torch.Tensor, *,
                 top_k: int, alpha: float, limit: float) -> None:
        self.router, self.router_bias = router, router_bias
        self.gate_up, self.gate_up_bias = gate_up, gate_up_bias
        self.down, self.down_bias = down, down_bias
        self.top_k, self.alpha, self.limit = top_k, alpha, limit
        self.num_experts = router.shape[0]

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Top-k ``(weights [T, k], experts [T, k] int64)``: softmax over the k logits."""
        logits = F.linear(x, self.router, self.router_bias)  # [T, E]
        top, experts = logits.topk(self.top_k, dim=-1)
        return top.softmax(-1), experts

    def _expert(self, expert: int, x: torch.Tensor) -> torch.Tensor:  # [n, H] -> [n, H]
        hidden = F.linear(x, self.gate_up[expert], self.gate_up_bias[expert])  # [n, 2I]
        inter = hidden.shape[1] // 2
        gate = hidden[:, :inter].clamp(max=self.limit)
        up = hidden[:, inter:].clamp(-self.limit, self.limit)
        act = (up + 1) * (gate * torch.sigmoid(gate * self.alpha))
        return F.linear(act, self.down[expert], self.down_bias[expert])

    def __call__(self, x: torch.Tensor) -> torch.Tensor:  # [T, H] -> [T, H]
        weights, experts = self.route(x)
        return grouped_by_expert(x, weights, experts, self.num_experts, self._expert)

    def add_to(self, x: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        return residual + self(x)


def load_gpt_oss_moe(tensor: Callable[[str], torch.Tensor], prefix: str, *, top_k: int,
                     alpha: float, limit: float) -> GptOssMoE:
    """The layer's experts from the canonical names (``tensor(name)``: placed on the device)."""
    experts = prefix + "experts."
    gate_up = torch.cat([tensor(experts + "gate_proj.weight"),
                         tensor(experts + "up_proj.weight")], 1)  # [E, 2I, H]
    gate_up_bias = torch.cat([tensor(experts + "gate_proj.bias"),
                              tensor(experts + "up_proj.bias")], 1)  # [E, 2I]
    return GptOssMoE(tensor(prefix + "gate.weight"), tensor(prefix + "gate.bias"),
                     gate_up.contiguous(), gate_up_bias.contiguous(),
                     tensor(experts + "down_proj.weight"), tensor(experts + "down_proj.bias"),
                     top_k=top_k, alpha=alpha, limit=limit)  # fmt: skip


__all__ = ["GptOssMoE", "load_gpt_oss_moe"]
