"""Model code, one file per architecture family; ``build_model`` picks by architecture."""

from __future__ import annotations

from collections.abc import Mapping

import torch

from prefixgate.gateway.engine.model_config import (
    SUPPORTED_ARCHITECTURES,
    ModelConfig,
    UnsupportedModelError,
)
from prefixgate.gateway.engine.models.forward_batch import ForwardBatch
from prefixgate.gateway.engine.models.llama import LlamaModel

# architecture -> model class; every supported one is a Llama variant today
MODEL_CLASSES: dict[str, type[LlamaModel]] = dict.fromkeys(SUPPORTED_ARCHITECTURES, LlamaModel)


def build_model(
    config: ModelConfig,
    weights: Mapping[str, torch.Tensor],
    *,
    device: torch.device | str = "cpu",
    dtype: torch.dtype = torch.float32,
    max_positions: int | None = None,
    kernel_backend: str | None = None,
    native_ops: bool = False,
    quantized_weights: bool = True,
) -> LlamaModel:
    """Instantiate the model class of ``config.architecture`` with ``weights`` on ``device``."""
    cls = MODEL_CLASSES.get(config.architecture)
    if cls is None:
        raise UnsupportedModelError(
            f"no model code for {config.architecture!r}; supported: {', '.join(MODEL_CLASSES)}"
        )
    return cls(
        config,
        weights,
        device=device,
        dtype=dtype,
        max_positions=max_positions,
        kernel_backend=kernel_backend,
        native_ops=native_ops,
        quantized_weights=quantized_weights,
    )


__all__ = ["MODEL_CLASSES", "ForwardBatch", "LlamaModel", "build_model"]
