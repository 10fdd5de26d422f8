"""The Llama family (llama, mistral, smollm2; Llama 3.x's RoPE scaling included) and Qwen2
(Llama plus q/k/v biases): plain configurations of the one decoder (models/decoder.py)."""

from __future__ import annotations

from prefixgate.engine.models.decoder import DecoderModel
from prefixgate.engine.models.registry import ModelFamily, register_family

LLAMA = register_family(
    ModelFamily(
        name="llama",
        model_class=DecoderModel,
        hf_model_types=("llama", "mistral", "smollm2"),
        gguf_architectures=("llama", "mistral", "smollm2"),
        # llama.cpp's converter interleaves the rotary halves of Q/K rows for llama archs
        gguf_permuted_qk=True,
    )
)
QWEN2 = register_family(
    ModelFamily(
        name="qwen2",
        model_class=DecoderModel,
        hf_model_types=("qwen2",),
        gguf_architectures=("qwen2",),
    )
)
