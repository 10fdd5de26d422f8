"""Tiny random Llama-family models written as real GGUF files / HF directories, for loader tests.

The weights are random (transformers' init) but the files are genuine: GGUFs are written with
``gguf.GGUFWriter`` the way llama.cpp's converter writes them (Q/K rows permuted, quantised
blocks), HF directories with ``save_pretrained``. The tokenizer is SmolLM2's (from the default
model's GGUF), so these models share its 49152-token vocabulary.
"""

from __future__ import annotations

import functools
from pathlib import Path
from typing import Any

import numpy as np
import torch
from gguf import GGMLQuantizationType, GGUFReader, GGUFWriter
from gguf.quants import quantize

Q = GGMLQuantizationType
VOCAB = 1024

# K-quant blocks (256 values) cannot be produced by gguf-py: build them from random bytes with
# sane fp16 scale fields. (block bytes, offsets of fp16 scale fields)
_K_QUANT_LAYOUT = {
    Q.Q4_K: (144, (0, 2)),  # d, dmin, scales[12], qs[128]
    Q.Q5_K: (176, (0, 2)),  # d, dmin, scales[12], qh[32], qs[128]
    Q.Q6_K: (210, (208,)),  # ql[128], qh[64], scales[16], d
}


def tiny_hf_model(arch: str = "llama", seed: int = 0, **overrides: Any):
    """A 2-layer random transformers model: hidden 256, 4 heads (2 KV), head_dim 64."""
    import transformers

    config_cls = {
        "llama": transformers.LlamaConfig,
        "mistral": transformers.MistralConfig,
        "qwen2": transformers.Qwen2Config,
    }[arch]
    model_cls = {
        "llama": transformers.LlamaForCausalLM,
        "mistral": transformers.MistralForCausalLM,
        "qwen2": transformers.Qwen2ForCausalLM,
    }[arch]
    settings: dict[str, Any] = {
        "vocab_size": VOCAB,
        "hidden_size": 256,
        "intermediate_size": 512,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "max_position_embeddings": 4096,
        "rms_norm_eps": 1e-5,
        "tie_word_embeddings": False,
        "bos_token_id": 1,
        "eos_token_id": 2,
    }
    settings.update(overrides)
    torch.manual_seed(seed)
    model = model_cls(config_cls(**settings)).eval()
    with torch.no_grad():  # bigger than the default init so a wrong weight shows in the logits
        for name, param in model.named_parameters():
            if name.endswith("bias"):
                param.normal_(0.0, 0.5)
            elif "norm" in name:
                param.uniform_(0.5, 1.5)
    return model.float()


def _permute(weight: np.ndarray, num_heads: int) -> np.ndarray:
    """llama.cpp's converter permutation of Q/K rows (what the loader must undo)."""
    return (
        weight.reshape(num_heads, 2, weight.shape[0] // num_heads // 2, *weight.shape[1:])
        .swapaxes(1, 2)
        .reshape(weight.shape)
    )


def _k_quant_bytes(
    shape: tuple[int, ...], qtype: GGMLQuantizationType, rng: np.random.Generator
) -> np.ndarray:
    block_bytes, scale_offsets = _K_QUANT_LAYOUT[qtype]
    rows, cols = shape
    blocks = rng.integers(0, 256, size=(rows, cols // 256, block_bytes), dtype=np.uint8)
    scale = np.frombuffer(np.float16(2e-4).tobytes(), dtype=np.uint8)
    for offset in scale_offsets:
        blocks[:, :, offset : offset + 2] = scale
    return blocks.reshape(rows, -1)


@functools.cache
def _vocab_metadata(default_gguf: Path) -> dict[str, Any]:
    reader = GGUFReader(default_gguf)
    fields = {
        name: reader.fields[f"tokenizer.{name}"].contents()
        for name in ("ggml.tokens", "ggml.token_type", "ggml.merges", "chat_template")
    }
    tokens = fields["ggml.tokens"][:VOCAB]
    known = set(tokens)
    fields["ggml.tokens"] = tokens
    fields["ggml.token_type"] = fields["ggml.token_type"][:VOCAB]
    fields["ggml.merges"] = [
        merge
        for merge in fields["ggml.merges"]
        if merge.replace(" ", "") in known and all(part in known for part in merge.split(" "))
    ]
    return fields


def write_gguf(
    path: Path,
    model,
    default_gguf: Path,
    *,
    arch: str = "llama",
    qtype: GGMLQuantizationType = Q.F32,
    extra_tensor: tuple[str, np.ndarray, GGMLQuantizationType] | None = None,
    chat_template: str | None = None,
) -> None:
    """Write ``model`` (a tiny_hf_model) as a llama.cpp-style GGUF; matrices in ``qtype``;
    the default model's chat template unless ``chat_template`` is given."""
    cfg = model.config
    heads, kv_heads = cfg.num_attention_heads, cfg.num_key_value_heads
    writer = GGUFWriter(str(path), arch)
    writer.add_name(f"tiny-{arch}")
    writer.add_context_length(cfg.max_position_embeddings)
    writer.add_embedding_length(cfg.hidden_size)
    writer.add_feed_forward_length(cfg.intermediate_size)
    writer.add_block_count(cfg.num_hidden_layers)
    writer.add_head_count(heads)
    writer.add_head_count_kv(kv_heads)
    writer.add_rope_dimension_count(cfg.hidden_size // heads)
    writer.add_rope_freq_base(float(cfg.rope_parameters["rope_theta"]))
    writer.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    writer.add_vocab_size(cfg.vocab_size)
    vocab = _vocab_metadata(default_gguf)
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("smollm")
    writer.add_token_list(vocab["ggml.tokens"])
    writer.add_token_types(vocab["ggml.token_type"])
    writer.add_token_merges(vocab["ggml.merges"])
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    writer.add_chat_template(chat_template or vocab["chat_template"])

    names = {
        "model.embed_tokens.weight": "token_embd.weight",
        "model.norm.weight": "output_norm.weight",
        "lm_head.weight": "output.weight",
    }
    per_layer = {
        "input_layernorm.weight": "attn_norm.weight",
        "self_attn.q_proj.weight": "attn_q.weight",
        "self_attn.k_proj.weight": "attn_k.weight",
        "self_attn.v_proj.weight": "attn_v.weight",
        "self_attn.q_proj.bias": "attn_q.bias",
        "self_attn.k_proj.bias": "attn_k.bias",
        "self_attn.v_proj.bias": "attn_v.bias",
        "self_attn.o_proj.weight": "attn_output.weight",
        "post_attention_layernorm.weight": "ffn_norm.weight",
        "mlp.gate_proj.weight": "ffn_gate.weight",
        "mlp.up_proj.weight": "ffn_up.weight",
        "mlp.down_proj.weight": "ffn_down.weight",
    }
    rng = np.random.default_rng(0)
    state = model.state_dict()
    if cfg.tie_word_embeddings:
        state.pop("lm_head.weight", None)
    for hf_name, tensor in state.items():
        if hf_name.startswith("model.layers."):
            layer, rest = hf_name[len("model.layers.") :].split(".", 1)
            name = f"blk.{layer}.{per_layer[rest]}"
        else:
            name = names[hf_name]
        array = tensor.detach().float().numpy()
        if arch == "llama" and name.endswith(("attn_q.weight", "attn_q.bias")):
            array = _permute(array, heads)
        elif arch == "llama" and name.endswith(("attn_k.weight", "attn_k.bias")):
            array = _permute(array, kv_heads)
        if array.ndim == 1 or qtype == Q.F32:
            writer.add_tensor(name, np.ascontiguousarray(array, dtype=np.float32))
        elif qtype in _K_QUANT_LAYOUT:
            writer.add_tensor(name, _k_quant_bytes(array.shape, qtype, rng), raw_dtype=qtype)
        else:
            writer.add_tensor(name, quantize(array, qtype), raw_dtype=qtype)
    if extra_tensor is not None:
        name, data, dtype = extra_tensor
        writer.add_tensor(name, data, raw_dtype=dtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def write_header_only_gguf(path: Path, arch: str) -> None:
    """A GGUF with an architecture name and nothing else (for unsupported-architecture tests)."""
    writer = GGUFWriter(str(path), arch)
    writer.add_block_count(1)
    writer.add_tensor("token_embd.weight", np.zeros((4, 8), dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def hf_logits_from_gguf(path: Path, ids: list[int]) -> torch.Tensor:
    """transformers' logits ``[T, V]`` for a GGUF file (the oracle for the loader)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(
        str(path.parent), gguf_file=path.name, dtype=torch.float32
    ).eval()
    with torch.inference_mode():
        return model(torch.tensor([ids])).logits[0].float()
