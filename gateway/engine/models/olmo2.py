"""OLMo 2: post-norm blocks and q/k norms over whole projections.

No norm before attention or the MLP: each output is RMS-normed (``post_attention_layernorm``,
``post_feedforward_layernorm``) and then added to the residual stream. q and k are RMS-normed
before RoPE over each token's whole projection (weights ``[heads * head_dim]``, not per head).
llama.cpp's ``olmo2`` files name those norms ``post_attention_norm`` / ``post_ffw_norm`` and
do not permute Q/K. llama.cpp converts OLMo 3 to the same architecture with sliding-window
layers (``attention.sliding_window``): not run here yet, so such a file is refused.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from prefixgate.gateway.engine.model_config import UnsupportedModelError
from prefixgate.gateway.engine.models.decoder import DecoderModel
from prefixgate.gateway.engine.models.qwen3 import QK_NORM_TENSORS
from prefixgate.gateway.engine.models.registry import ModelFamily, register_family

_OPTIONS = {"qk_norm": True, "qk_norm_full": True, "pre_norms": False, "sandwich_norms": True}


def _hf_config(_raw: dict[str, Any]) -> dict[str, Any]:
    return dict(_OPTIONS)


def _gguf_config(meta: Callable[..., Any]) -> dict[str, Any]:
    if meta("attention.sliding_window"):
        raise UnsupportedModelError(
            "olmo2 GGUF with sliding-window layers (OLMo 3) is not supported yet"
        )
    return dict(_OPTIONS)


OLMO2 = register_family(
    ModelFamily(
        name="olmo2",
        model_class=DecoderModel,
        hf_model_types=("olmo2",),
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
