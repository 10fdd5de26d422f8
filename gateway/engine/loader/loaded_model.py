"""The record every loader returns: config, weights by HF parameter name, tokenizer."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from prefixgate.gateway.engine.model_config import ModelConfig
from prefixgate.gateway.engine.tokenizer import Tokenizer


@dataclass(frozen=True, slots=True)
class LoadedModel:
    """A model read from disk, not yet placed on a device.

    ``weights`` uses Hugging Face parameter names (``model.layers.0.self_attn.q_proj.weight``...)
    in HF's orientation (``[out_features, in_features]``, Q/K rows in HF's rotary order), on CPU,
    fp32 after dequantisation (or as stored for HF safetensors). ``lm_head.weight`` is absent
    when ``config.tie_word_embeddings``.
    """

    config: ModelConfig
    weights: dict[str, torch.Tensor]
    tokenizer: Tokenizer
    path: Path

    @property
    def name(self) -> str:
        """The model's own name (served as the OpenAI ``model`` when none is configured)."""
        return self.config.name
