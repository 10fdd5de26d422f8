"""OLMo 2 and OLMo 3: post-norm blocks and q/k norms over whole projections.

No norm before attention or the MLP: each output is RMS-normed (``post_attention_layernorm``,
``post_feedforward_layernorm``) and then added to the residual stream. q and k are RMS-normed
before RoPE over each token's whole projection (weights ``[heads * head_dim]``, not per head).
OLMo 3 is OLMo 2 with sliding-window layers (three in four; ``layer_types``); they rotate
with their own RoPE (no scaling), as the global layers do with the model's. llama.cpp converts
both to its ``olmo2`` architecture (OLMo 3: ``attention.sliding_window`` and a per-layer
``attention.sliding_window_pattern``), names the post norms ``post_attention_norm`` /
``post_ffw_norm`` and does not permute Q/K.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from prefixgate.engine.model_config import UnsupportedModelError
from prefixgate.engine.models.decoder import DecoderModel
from prefixgate.engine.models.qwen3 import QK_NORM_TENSORS
from prefixgate.engine.models.registry import ModelFamily, register_family

_OPTIONS = {"qk_norm": True, "qk_norm_full": True, "pre_norms": False, "sandwich_norms": True}
_FULL_EVERY = 4  # OLMo 3's default pattern (transformers' and llama.cpp's): every 4th is global
_LAYER_TYPES = {"sliding_attention": "sliding", "full_attention": "full"}


def _default_pattern(layers: int) -> tuple[str, ...]:
    return tuple("full" if (i + 1) % _FULL_EVERY == 0 else "sliding" for i in range(layers))


def _hf_config(raw: dict[str, Any]) -> dict[str, Any]:
    if raw.get("model_type") != "olmo3":
        return dict(_OPTIONS)
    names = raw.get("layer_types")
    if names is None:
        types = _default_pattern(int(raw["num_hidden_layers"]))
    else:
        unknown = sorted(set(names) - set(_LAYER_TYPES))
        if unknown:
            raise UnsupportedModelError(f"OLMo 3 layer types {unknown} are not supported")
        types = tuple(_LAYER_TYPES[name] for name in names)
    local = ((raw.get("rope_parameters") or {}).get("sliding_attention") or {}).get("rope_theta")
    return {
        **_OPTIONS,
        "sliding_window": int(raw["sliding_window"]),
        "layer_types": types,
        "rope_local_theta": float(local or raw.get("rope_theta") or 10000.0),
    }


def _gguf_config(meta: Callable[..., Any]) -> dict[str, Any]:
    window = meta("attention.sliding_window")
    if not window:  # OLMo 2
        return dict(_OPTIONS)
    pattern = meta("attention.sliding_window_pattern")  # one bool per layer, True = sliding
    if isinstance(pattern, list):
        types = tuple("sliding" if sliding else "full" for sliding in pattern)
    else:
        types = _default_pattern(int(meta("block_count")))
    return {
        **_OPTIONS,
        "sliding_window": int(window),
        "layer_types": types,
        "rope_local_theta": float(meta("rope.freq_base_swa", meta("rope.freq_base", 10000.0))),
    }


OLMO2 = register_family(
    ModelFamily(
        name="olmo2",
        model_class=DecoderModel,
        hf_model_types=("olmo2", "olmo3"),
        gguf_architectures=("olmo2",),
        hf_config=_hf_config,
        gguf_config=_gguf_config,
        gguf_tensors={
            **QK_NORM_TENSORS,
            "post_attention_norm.weight": "post_attention_layernorm.weight",
            "post_ffw_norm.weight": "post_feedforward_layernorm.weight",
        },
    )
)
