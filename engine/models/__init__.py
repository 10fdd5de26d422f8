"""Model code: one decoder (models/decoder.py) every family configures, and one file per
architecture family that registers itself (models/registry.py); ``build_model`` picks by
architecture."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from prefixgate.engine.model_config import ModelConfig
from prefixgate.engine.models.decoder import DecoderModel
from prefixgate.engine.models.forward_batch import ForwardBatch
from prefixgate.engine.models.registry import families, family_for
from prefixgate.kernels.layer_ops import KernelChoice

# every family module registers itself on import; the Llama family first, so messages that
# list the supported architectures start with the common ones
# isort: off
from prefixgate.engine.models import llama  # noqa: F401, E402
from prefixgate.engine.models import qwen3, qwen3_moe, gemma3, phi3  # noqa: F401, E402
from prefixgate.engine.models import qwen3_5  # noqa: F401, E402
from prefixgate.engine.models import smollm3, granite, olmo2  # noqa: F401, E402
from prefixgate.engine.models import gpt_oss  # noqa: F401, E402
# isort: on


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
    int8_activations: bool = False,
    whole_step: bool = True,
) -> Any:
    """Instantiate the model class of ``config.architecture``'s family on ``device``, its
    kernels chosen from the rest (``KernelChoice``, kernels/layer_ops.py)."""
    cls = family_for(config.architecture).model_class
    choice = KernelChoice(kernel_backend, native_ops, quantized_weights, int8_activations,
                          whole_step)
    return cls(config, weights, device=device, dtype=dtype, max_positions=max_positions,
               kernels=choice)


__all__ = ["DecoderModel", "ForwardBatch", "build_model", "families", "family_for"]
