"""Qwen3 (dense): the Llama layout plus an RMSNorm over every q and k head before RoPE."""

from __future__ import annotations

from typing import Any

from prefixgate.engine.models.decoder import DecoderModel
from prefixgate.engine.models.registry import ModelFamily, register_family

# llama.cpp's names for the per-head norms (shared by the Qwen3 and Gemma 3 files)
QK_NORM_TENSORS = {
    "attn_q_norm.weight": "self_attn.q_norm.weight",
    "attn_k_norm.weight": "self_attn.k_norm.weight",
}


def _qk_norm(_source: Any) -> dict[str, Any]:
    return {"qk_norm": True}


QWEN3 = register_family(
    ModelFamily(
        name="qwen3",
        model_class=DecoderModel,
        hf_model_types=("qwen3",),
        gguf_architectures=("qwen3",),
        hf_config=_qk_norm,
        gguf_config=_qk_norm,
        gguf_tensors=QK_NORM_TENSORS,
    )
)
