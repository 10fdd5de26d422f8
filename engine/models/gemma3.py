"""Gemma 3 (text): sandwich norms, ``1 + w`` norms, GeGLU, scaled embeddings, q/k norms,
final logit softcapping, and local (sliding-window) layers between global ones.

The local layers have their own RoPE base (10,000) and no RoPE scaling; the global layers use
``rope_theta`` and the scaling. llama.cpp's GGUFs store every norm weight as ``1 + w`` and
carry no layer pattern (llama.cpp fixes it: every 6th layer is global) nor
``query_pre_attn_scalar`` (it scales by ``head_dim``); the loader follows llama.cpp there.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from prefixgate.engine.model_config import UnsupportedModelError
from prefixgate.engine.models.decoder import DecoderModel
from prefixgate.engine.models.qwen3 import QK_NORM_TENSORS
from prefixgate.engine.models.registry import ModelFamily, register_family

_LOCAL_ROPE_THETA = 10000.0
_GGUF_GLOBAL_EVERY = 6  # llama.cpp's Gemma 3 layer pattern
_LAYER_TYPES = {"sliding_attention": "sliding", "full_attention": "full"}


def _common(hidden: int) -> dict[str, Any]:
    return {
        "qk_norm": True,
        "norm_weight_offset": 1.0,
        "activation": "gelu_tanh",
        "embedding_scale": hidden**0.5,
        "sandwich_norms": True,
    }


def _hf_layer_types(raw: dict[str, Any]) -> tuple[str, ...]:
    layers = int(raw["num_hidden_layers"])
    types = raw.get("layer_types")
    if types is None:  # transformers 4 configs: a period instead of a list
        every = int(raw.get("sliding_window_pattern") or _GGUF_GLOBAL_EVERY)
        types = [
            "full_attention" if (i + 1) % every == 0 else "sliding_attention" for i in range(layers)
        ]
    unknown = sorted(set(types) - set(_LAYER_TYPES))
    if unknown:
        raise UnsupportedModelError(f"Gemma 3 layer types {unknown} are not supported")
    return tuple(_LAYER_TYPES[t] for t in types)


def _hf_config(raw: dict[str, Any]) -> dict[str, Any]:
    if raw.get("attn_logit_softcapping"):
        raise UnsupportedModelError("attention logit softcapping (Gemma 2) is not supported")
    if raw.get("use_bidirectional_attention"):
        raise UnsupportedModelError("bidirectional attention (EmbeddingGemma) is not supported")
    rope = raw.get("rope_parameters") or {}
    local = (rope.get("sliding_attention") or {}).get("rope_theta")
    return {
        **_common(int(raw["hidden_size"])),
        "final_logit_softcapping": raw.get("final_logit_softcapping"),
        "query_pre_attn_scalar": raw.get("query_pre_attn_scalar"),
        "sliding_window": int(raw["sliding_window"]),
        "layer_types": _hf_layer_types(raw),
        "rope_local_theta": float(local or raw.get("rope_local_base_freq") or _LOCAL_ROPE_THETA),
    }


def _gguf_config(meta: Callable[..., Any]) -> dict[str, Any]:
    layers = int(meta("block_count"))
    pattern = meta("attention.sliding_window_pattern")
    if isinstance(pattern, list):  # newer converters: one bool per layer (True = sliding)
        types = tuple("sliding" if p else "full" for p in pattern)
    else:
        every = int(pattern or _GGUF_GLOBAL_EVERY)
        types = tuple("full" if (i + 1) % every == 0 else "sliding" for i in range(layers))
    return {
        **_common(int(meta("embedding_length"))),
        "final_logit_softcapping": meta("final_logit_softcapping"),
        "sliding_window": int(meta("attention.sliding_window")),
        "layer_types": types,
        "rope_local_theta": float(meta("rope.freq_base_swa", _LOCAL_ROPE_THETA)),
    }


def _unshift_gguf_norms(weights: dict[str, Any], _config: Any, fmt: str) -> dict[str, Any]:
    if fmt != "gguf":
        return weights
    return {
        name: tensor - 1.0
        if name.endswith("norm.weight") and isinstance(tensor, torch.Tensor)
        else tensor
        for name, tensor in weights.items()
    }


GEMMA3 = register_family(
    ModelFamily(
        name="gemma3",
        model_class=DecoderModel,
        hf_model_types=("gemma3_text",),
        gguf_architectures=("gemma3",),
        hf_config=_hf_config,
        gguf_config=_gguf_config,
        gguf_tensors={
            **QK_NORM_TENSORS,
            "post_attention_norm.weight": "post_attention_layernorm.weight",
            "ffn_norm.weight": "pre_feedforward_layernorm.weight",
            "post_ffw_norm.weight": "post_feedforward_layernorm.weight",
        },
        adapt_weights=_unshift_gguf_norms,
        activations=("gelu_pytorch_tanh",),
    )
)
