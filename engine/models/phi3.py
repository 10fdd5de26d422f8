"""Phi-3 / Phi-3.5 / Phi-4-mini: the Llama layer with q|k|v and gate|up stored fused.

The fused tensors (HF ``qkv_proj`` / ``gate_up_proj``, GGUF ``attn_qkv`` / a double-height
``ffn_up``) are split into the Llama names at load; the Llama model fuses them again for its
GEMMs. Phi-4-mini's partial rotary (RoPE on the first 3/4 of each head) runs on the
configurable decoder; LongRoPE is read by the loaders (short factors, context capped at the
original length; from GGUF, llama.cpp's ``rope_factors_short`` tensor).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from prefixgate.engine.models.decoder import DecoderModel
from prefixgate.engine.models.registry import ModelFamily, register_family
from prefixgate.kernels.quant import QuantizedTensor


def _hf_config(raw: dict[str, Any]) -> dict[str, Any]:
    rope = raw.get("rope_parameters") or {}
    partial = float(raw.get("partial_rotary_factor") or rope.get("partial_rotary_factor") or 1.0)
    heads = int(raw["num_attention_heads"])
    head_dim = int(raw.get("head_dim") or int(raw["hidden_size"]) // heads)
    return {"rotary_dim": int(head_dim * partial)} if partial != 1.0 else {}


def _gguf_config(meta: Callable[..., Any]) -> dict[str, Any]:
    heads, hidden = meta("attention.head_count"), meta("embedding_length")
    head_dim = meta("attention.key_length", hidden // heads)
    rotary = int(meta("rope.dimension_count", head_dim))
    return {"rotary_dim": rotary} if rotary != head_dim else {}


def _rows(tensor: Any, start: int, stop: int) -> Any:
    if isinstance(tensor, QuantizedTensor):  # whole rows of blocks: still in blocks
        data = tensor.data[start:stop].clone()
        return QuantizedTensor(tensor.qtype, data, (stop - start, tensor.shape[1]))
    return tensor[start:stop].contiguous()


def _split_fused(weights: dict[str, Any], config: Any, _fmt: str) -> dict[str, Any]:
    out: dict[str, Any] = {}
    q, kv, inter = config.q_size, config.kv_size, config.intermediate_size
    for name, tensor in weights.items():
        if name.endswith("self_attn.qkv_proj.weight"):
            prefix = name[: -len("qkv_proj.weight")]
            out[prefix + "q_proj.weight"] = _rows(tensor, 0, q)
            out[prefix + "k_proj.weight"] = _rows(tensor, q, q + kv)
            out[prefix + "v_proj.weight"] = _rows(tensor, q + kv, q + 2 * kv)
        elif name.endswith("mlp.gate_up_proj.weight"):
            prefix = name[: -len("gate_up_proj.weight")]
            out[prefix + "gate_proj.weight"] = _rows(tensor, 0, inter)
            out[prefix + "up_proj.weight"] = _rows(tensor, inter, 2 * inter)
        else:
            out[name] = tensor
    return out


PHI3 = register_family(
    ModelFamily(
        name="phi3",
        model_class=DecoderModel,
        hf_model_types=("phi3",),
        gguf_architectures=("phi3",),
        hf_config=_hf_config,
        gguf_config=_gguf_config,
        gguf_tensors={
            "attn_qkv.weight": "self_attn.qkv_proj.weight",
            "ffn_up.weight": "mlp.gate_up_proj.weight",
        },
        adapt_weights=_split_fused,
    )
)
