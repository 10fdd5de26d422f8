"""Granite 3.x (dense): the Llama layer with four multipliers.

The embeddings are multiplied by ``embedding_multiplier``, attention and MLP outputs by
``residual_multiplier`` before they join the residual stream, the softmax scale is
``attention_multiplier`` itself (not ``head_dim ** -0.5``), and the logits are divided by
``logits_scaling``. llama.cpp's converter writes them as ``embedding_scale``,
``residual_scale``, ``attention.scale`` and ``logit_scale`` (and permutes Q/K as for llama).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from prefixgate.engine.models.decoder import DecoderModel
from prefixgate.engine.models.registry import ModelFamily, register_family


def _options(embedding: Any, residual: Any, attention: Any, logits: Any) -> dict[str, Any]:
    # 1.0 (or absent) is no multiplier: the decoder keeps its fused residual add there
    def scale(value: Any) -> float | None:
        return None if value is None or float(value) == 1.0 else float(value)

    return {
        "embedding_scale": scale(embedding),
        "residual_scale": scale(residual),
        "attention_multiplier": None if attention is None else float(attention),
        "logits_scaling": scale(logits),
    }


def _hf_config(raw: dict[str, Any]) -> dict[str, Any]:
    # transformers' defaults are 1.0 each; the attention scale is then 1.0 too, not 1/sqrt(d)
    return _options(
        raw.get("embedding_multiplier", 1.0), raw.get("residual_multiplier", 1.0),
        raw.get("attention_multiplier", 1.0), raw.get("logits_scaling", 1.0),
    )  # fmt: skip


def _gguf_config(meta: Callable[..., Any]) -> dict[str, Any]:
    # llama.cpp: an absent (0) attention.scale means 1/sqrt(head_dim)
    return _options(
        meta("embedding_scale"), meta("residual_scale"),
        meta("attention.scale") or None, meta("logit_scale"),
    )  # fmt: skip


GRANITE = register_family(
    ModelFamily(
        name="granite",
        model_class=DecoderModel,
        hf_model_types=("granite",),
        gguf_architectures=("granite",),
        hf_config=_hf_config,
        gguf_config=_gguf_config,
        gguf_permuted_qk=True,  # converted by llama.cpp's LlamaModel
    )
)
