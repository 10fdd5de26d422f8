"""SmolLM3: the Llama layer with RoPE left out of every fourth layer (NoPE layers).

HF ``config.json`` lists the layers that rotate (``no_rope_layers``: 1 = RoPE on) or gives
their period (``no_rope_layer_interval``, 4). llama.cpp writes no pattern into the GGUF: its
``smollm3`` graph fixes the step at 4 (``n_no_rope_layer_step``), and so does this loader. The
chat template's ``/think`` / ``/no_think`` system flags and ``enable_thinking`` are the
template's own (it renders an empty ``<think>`` span when thinking is off); the reasoning
splitter reads its ``<think>`` span like Qwen3's (server/tools/formats/reasoning.py).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from prefixgate.engine.model_config import UnsupportedModelError
from prefixgate.engine.models.decoder import DecoderModel
from prefixgate.engine.models.registry import ModelFamily, register_family

_GGUF_NO_ROPE_EVERY = 4  # llama.cpp: hparams.n_no_rope_layer_step


def _every(layers: int, period: int) -> tuple[bool, ...]:
    return tuple((i + 1) % period != 0 for i in range(layers))


def _hf_config(raw: dict[str, Any]) -> dict[str, Any]:
    if raw.get("use_sliding_window"):
        raise UnsupportedModelError("SmolLM3 with use_sliding_window is not supported")
    flags = raw.get("no_rope_layers")
    if flags is None:
        period = int(raw.get("no_rope_layer_interval") or _GGUF_NO_ROPE_EVERY)
        return {"rope_layers": _every(int(raw["num_hidden_layers"]), period)}
    return {"rope_layers": tuple(bool(flag) for flag in flags)}


def _gguf_config(meta: Callable[..., Any]) -> dict[str, Any]:
    return {"rope_layers": _every(int(meta("block_count")), _GGUF_NO_ROPE_EVERY)}


SMOLLM3 = register_family(
    ModelFamily(
        name="smollm3",
        model_class=DecoderModel,
        hf_model_types=("smollm3",),
        gguf_architectures=("smollm3",),
        hf_config=_hf_config,
        gguf_config=_gguf_config,
        gguf_permuted_qk=True,  # converted by llama.cpp's LlamaModel
    )
)
