"""The record every loader returns: config, weights by HF parameter name, tokenizer."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from prefixgate.engine.model_config import ModelConfig
from prefixgate.engine.tokenizer import Tokenizer
from prefixgate.kernels.quant import QuantizedTensor


@dataclass(frozen=True, slots=True)
class LoadedModel:
    """A model read from disk, not yet placed on a device.

    ``weights`` uses Hugging Face parameter names (``model.layers.0.self_attn.q_proj.weight``...)
    in HF's orientation (``[out_features, in_features]``, Q/K rows in HF's rotary order), on CPU:
    from GGUF, Q4_0/Q4_1/Q8_0 matrices as ``QuantizedTensor`` (ggml blocks; ``.dequantize()``
    gives their exact fp32 values) and the rest fp32; from HF safetensors, as stored.
    ``lm_head.weight`` is absent when ``config.tie_word_embeddings``.
    """

    config: ModelConfig
    weights: dict[str, torch.Tensor | QuantizedTensor]
    tokenizer: Tokenizer
    path: Path

    @property
    def name(self) -> str:
        """The model's own name (served as the OpenAI ``model`` when none is configured)."""
        return self.config.name
