"""Qwen3-MoE (Qwen3-30B-A3B, Qwen3-Coder-30B-A3B): Qwen3's attention, a routed expert MLP.

HF checkpoints store one tensor per expert (``mlp.experts.<e>.gate_proj.weight``); GGUF
stacks them (``ffn_gate_exps``). Both become the stacked ``mlp.experts.gate_proj.weight``
``[E, I, H]`` that models/moe.py reads.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import Any

import torch

from prefixgate.engine.model_config import UnsupportedModelError
from prefixgate.engine.models.decoder import DecoderModel
from prefixgate.engine.models.moe import StackedExperts
from prefixgate.engine.models.qwen3 import QK_NORM_TENSORS
from prefixgate.engine.models.registry import ModelFamily, register_family
from prefixgate.kernels.quant import QuantizedTensor

_EXPERT = re.compile(r"^(model\.layers\.\d+\.mlp\.experts)\.(\d+)\.(gate|up|down)_proj\.weight$")


def _hf_config(raw: dict[str, Any]) -> dict[str, Any]:
    if raw.get("mlp_only_layers") or int(raw.get("decoder_sparse_step", 1)) != 1:
        raise UnsupportedModelError(
            "Qwen3-MoE with dense layers (mlp_only_layers) is not supported"
        )
    return {
        "qk_norm": True,
        # Qwen's own configs say num_experts; transformers 5 saves num_local_experts
        "num_experts": int(raw.get("num_experts") or raw["num_local_experts"]),
        "num_experts_per_tok": int(raw["num_experts_per_tok"]),
        "moe_intermediate_size": int(raw["moe_intermediate_size"]),
        "norm_topk_prob": bool(raw.get("norm_topk_prob", False)),
    }


def _gguf_config(meta: Callable[..., Any]) -> dict[str, Any]:
    moe = int(meta("expert_feed_forward_length", 0))
    return {
        "qk_norm": True,
        "num_experts": int(meta("expert_count", 0)),
        "num_experts_per_tok": int(meta("expert_used_count", 0)),
        "moe_intermediate_size": moe,
        # llama.cpp's qwen3moe graph always renormalises the top-k weights
        "norm_topk_prob": True,
        "intermediate_size": int(meta("feed_forward_length", 0)) or moe,
    }


def stack_experts(weights: dict[str, Any], config: Any, fmt: str) -> dict[str, Any]:
    if fmt != "hf":  # GGUF experts come stacked; in blocks as one [E * I, H] matrix each
        return {
            name: StackedExperts.from_rows(tensor, config.num_experts)
            if isinstance(tensor, QuantizedTensor) and ".mlp.experts." in name
            else tensor
            for name, tensor in weights.items()
        }
    parts: dict[tuple[str, str], dict[int, torch.Tensor]] = {}
    out: dict[str, Any] = {}
    for name, tensor in weights.items():
        match = _EXPERT.match(name)
        if match is None:
            out[name] = tensor
            continue
        prefix, expert, part = match.groups()
        if isinstance(tensor, QuantizedTensor):
            tensor = tensor.dequantize()
        parts.setdefault((prefix, part), {})[int(expert)] = tensor
    for (prefix, part), by_expert in parts.items():
        if sorted(by_expert) != list(range(config.num_experts)):
            raise UnsupportedModelError(f"{prefix}: experts {sorted(by_expert)} are incomplete")
        out[f"{prefix}.{part}_proj.weight"] = torch.stack([by_expert[e] for e in sorted(by_expert)])
    return out


QWEN3_MOE = register_family(
    ModelFamily(
        name="qwen3_moe",
        model_class=DecoderModel,
        hf_model_types=("qwen3_moe",),
        gguf_architectures=("qwen3moe",),
        hf_config=_hf_config,
        gguf_config=_gguf_config,
        gguf_tensors={
            **QK_NORM_TENSORS,
            "ffn_gate_inp.weight": "mlp.gate.weight",
            "ffn_gate_exps.weight": "mlp.experts.gate_proj.weight",
            "ffn_up_exps.weight": "mlp.experts.up_proj.weight",
            "ffn_down_exps.weight": "mlp.experts.down_proj.weight",
        },
        adapt_weights=stack_experts,
    )
)
