"""A GGUF writer for the family fixtures, written to llama.cpp's conventions (not ours).

It reads the HF directory's safetensors (as llama.cpp's ``convert_hf_to_gguf.py`` does) and
writes what that converter writes for each architecture: llama.cpp tensor names, Q/K rows
permuted for ``llama``, Gemma's norm weights stored as ``1 + w``, MoE experts stacked into
``ffn_*_exps``, Phi-3's fused ``attn_qkv`` / ``ffn_up`` kept fused, Llama 3.x scaling as a
``rope_freqs`` tensor, and the real tokenizer copied field by field from a vocab-only GGUF.
All tensors F32, so the loader must reproduce transformers' weights exactly.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import numpy as np
import torch
from gguf import GGMLQuantizationType, GGUFReader, GGUFValueType, GGUFWriter
from gguf.quants import quantize
from safetensors.torch import load_file

_GLOBAL = {
    "model.embed_tokens.weight": "token_embd.weight",
    "model.norm.weight": "output_norm.weight",
    "lm_head.weight": "output.weight",
}
_LAYER = {
    "input_layernorm": "attn_norm",
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output",
    "self_attn.qkv_proj": "attn_qkv",
    "self_attn.q_norm": "attn_q_norm",
    "self_attn.k_norm": "attn_k_norm",
    "post_attention_layernorm": "ffn_norm",
    "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up",
    "mlp.gate_up_proj": "ffn_up",  # phi3: gate|up stay fused in ffn_up
    "mlp.down_proj": "ffn_down",
    "mlp.gate": "ffn_gate_inp",  # the MoE router
}
_GEMMA_LAYER = {
    "post_attention_layernorm": "post_attention_norm",
    "pre_feedforward_layernorm": "ffn_norm",
    "post_feedforward_layernorm": "post_ffw_norm",
}
# Qwen3.5 (conversion/qwen.py, gguf-py's tensor_mapping.py); attention's q_proj stays as HF
# stores it (q and the output gate interleaved per head), the graph splits it
_QWEN35_ARCHS = frozenset({"qwen35", "qwen35moe"})
_QWEN35_LAYER = {
    "post_attention_layernorm": "post_attention_norm",
    "linear_attn.in_proj_qkv": "attn_qkv",
    "linear_attn.in_proj_z": "attn_gate",
    "linear_attn.in_proj_b": "ssm_beta",
    "linear_attn.in_proj_a": "ssm_alpha",
    "linear_attn.conv1d": "ssm_conv1d",
    "linear_attn.dt_bias": "ssm_dt",  # its ".bias" suffix: see _layer_tensors
    "linear_attn.A_log": "ssm_a",  # no suffix
    "linear_attn.norm": "ssm_norm",
    "linear_attn.out_proj": "ssm_out",
    "mlp.shared_expert.gate_proj": "ffn_gate_shexp",
    "mlp.shared_expert.up_proj": "ffn_up_shexp",
    "mlp.shared_expert.down_proj": "ffn_down_shexp",
    "mlp.shared_expert_gate": "ffn_gate_inp_shexp",
}
# what the converter keeps in F32 whatever the file type (besides 1-D tensors and norms)
_F32_TENSORS = ("ffn_gate_inp.weight", "ffn_gate_inp_shexp.weight", "ssm_conv1d.weight")
# llama.cpp converts these with its LlamaModel, which permutes Q/K rows
_PERMUTED_ARCHS = frozenset({"llama", "smollm3", "granite"})
_NAME = re.compile(r"^model\.layers\.(\d+)\.(.+?)(?:\.(weight|bias))?$")
_EXPERT = re.compile(r"^mlp\.experts\.(\d+)\.(gate|up|down)_proj$")


def _copy_tokenizer(writer: GGUFWriter, vocab: Path) -> None:
    reader = GGUFReader(vocab)
    for key, field in reader.fields.items():
        if not key.startswith("tokenizer.") or key == "tokenizer.chat_template":
            continue
        main = field.types[0]
        sub = field.types[-1] if main == GGUFValueType.ARRAY else None
        writer.add_key_value(key, field.contents(), main, sub)


def _write_metadata(writer: GGUFWriter, cfg: Any, arch: str) -> None:
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    writer.add_name(f"tiny-{arch}")
    writer.add_context_length(cfg.max_position_embeddings)
    writer.add_embedding_length(cfg.hidden_size)
    writer.add_feed_forward_length(cfg.intermediate_size)
    writer.add_block_count(cfg.num_hidden_layers)
    writer.add_head_count(cfg.num_attention_heads)
    writer.add_head_count_kv(cfg.num_key_value_heads)
    writer.add_key_length(head_dim)
    writer.add_value_length(head_dim)
    rope = cfg.rope_parameters
    partial = getattr(cfg, "partial_rotary_factor", None) or rope.get("partial_rotary_factor") or 1
    writer.add_rope_dimension_count(int(head_dim * partial))
    if "full_attention" in rope:  # per layer type; the file carries the global layers' base
        rope = rope["full_attention"]
    writer.add_rope_freq_base(float(rope["rope_theta"]))
    writer.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    writer.add_vocab_size(cfg.vocab_size)
    if arch == "qwen3moe":
        writer.add_expert_count(cfg.num_experts)
        writer.add_expert_used_count(cfg.num_experts_per_tok)
        writer.add_expert_feed_forward_length(cfg.moe_intermediate_size)
    if arch == "granite":  # llama.cpp's GraniteModel: the multipliers as *_scale keys
        writer.add_attention_scale(cfg.attention_multiplier)
        writer.add_embedding_scale(cfg.embedding_multiplier)
        writer.add_residual_scale(cfg.residual_multiplier)
        writer.add_logit_scale(cfg.logits_scaling)
    if arch in _QWEN35_ARCHS:
        _write_qwen35_metadata(writer, cfg, arch)
    if arch == "olmo2" and getattr(cfg, "layer_types", None):  # OLMo 3 (conversion/olmo.py)
        writer.add_sliding_window(cfg.sliding_window)
        writer.add_sliding_window_pattern([t == "sliding_attention" for t in cfg.layer_types])
    if arch == "gemma3":
        writer.add_sliding_window(cfg.sliding_window)
        if cfg.final_logit_softcapping:
            writer.add_final_logit_softcapping(cfg.final_logit_softcapping)


def _write_qwen35_metadata(writer: GGUFWriter, cfg: Any, arch: str) -> None:
    """llama.cpp's Qwen3NextModel / Qwen3_5*TextModel keys: the DeltaNet shape as ``ssm.*``,
    the layer pattern (``attention.recurrent_layers``, one bool per layer, and the interval),
    MRoPE's default sections (text positions make them plain RoPE), the MoE sizes."""
    writer.add_ssm_conv_kernel(cfg.linear_conv_kernel_dim)
    writer.add_ssm_state_size(cfg.linear_key_head_dim)
    writer.add_ssm_group_count(cfg.linear_num_key_heads)
    writer.add_ssm_time_step_rank(cfg.linear_num_value_heads)
    writer.add_ssm_inner_size(cfg.linear_value_head_dim * cfg.linear_num_value_heads)
    writer.add_array(f"{arch}.attention.recurrent_layers",
                     [t == "linear_attention" for t in cfg.layer_types])
    writer.add_full_attention_interval(getattr(cfg, "full_attention_interval", None) or 4)
    writer.add_rope_dimension_sections([11, 11, 10, 0])
    if arch == "qwen35moe":
        writer.add_expert_count(cfg.num_experts)
        writer.add_expert_used_count(cfg.num_experts_per_tok)
        writer.add_expert_feed_forward_length(cfg.moe_intermediate_size)
        writer.add_expert_shared_feed_forward_length(cfg.shared_expert_intermediate_size)


def _tile_v_heads(array: np.ndarray, axis: int, cfg: Any, head_dim: int) -> np.ndarray:
    """llama.cpp's ``_reorder_v_heads``: V heads grouped by their K head ``[K, V/K, d]`` become
    tiled ``[V/K, K, d]`` along ``axis`` (ggml broadcasts K heads that way)."""
    num_k = cfg.linear_num_key_heads
    per_k = cfg.linear_num_value_heads // num_k
    moved = np.moveaxis(array, axis, 0)
    tiled = moved.reshape(num_k, per_k, head_dim, *moved.shape[1:]).swapaxes(0, 1)
    return np.moveaxis(tiled.reshape(moved.shape), 0, axis)


def _qwen35_tensor(module: str, array: np.ndarray, cfg: Any) -> tuple[str, np.ndarray]:
    """One Qwen3.5 layer tensor as llama.cpp's converter writes it (conversion/qwen.py):
    renamed, ``A_log`` as ``-exp(A_log)``, the conv squeezed to ``[C, K]``, every norm but the
    DeltaNet's output norm as ``1 + w``, and (fewer K than V heads) the V heads tiled."""
    name = _QWEN35_LAYER.get(module) or _LAYER[module]
    if module.endswith("norm") and module != "linear_attn.norm":
        array = array + 1.0
    if module == "linear_attn.A_log":  # torch's exp, as the converter's (numpy's rounds apart)
        array = -torch.from_numpy(array).exp().numpy()
    elif module == "linear_attn.conv1d":
        array = array.squeeze()
    if module.startswith("linear_attn.") and cfg.linear_num_key_heads != cfg.linear_num_value_heads:
        v_dim = cfg.linear_value_head_dim
        qk_rows = 2 * cfg.linear_num_key_heads * cfg.linear_key_head_dim
        if module in ("linear_attn.in_proj_qkv", "linear_attn.conv1d"):  # only the V rows
            v_rows = _tile_v_heads(array[qk_rows:], 0, cfg, v_dim)
            array = np.concatenate([array[:qk_rows], v_rows])
        elif module == "linear_attn.in_proj_z":
            array = _tile_v_heads(array, 0, cfg, v_dim)
        elif module in ("linear_attn.in_proj_a", "linear_attn.in_proj_b", "linear_attn.A_log",
                        "linear_attn.dt_bias"):
            array = _tile_v_heads(array, 0, cfg, 1)
        elif module == "linear_attn.out_proj":  # its input columns
            array = _tile_v_heads(array, 1, cfg, v_dim)
    return name, array


def _permute(weight: np.ndarray, num_heads: int) -> np.ndarray:
    """llama.cpp's converter permutation of llama Q/K rows (rotate-half -> interleaved)."""
    return (
        weight.reshape(num_heads, 2, weight.shape[0] // num_heads // 2, *weight.shape[1:])
        .swapaxes(1, 2)
        .reshape(weight.shape)
    )


def _layer_tensors(arch: str, cfg: Any, state: dict[str, torch.Tensor]) -> dict[str, np.ndarray]:
    out: dict[str, np.ndarray] = {}
    experts: dict[tuple[int, str], dict[int, np.ndarray]] = {}
    # OLMo 2 names its post norms as Gemma 3 does (post_attention_norm, post_ffw_norm)
    names = {**_LAYER, **_GEMMA_LAYER} if arch in ("gemma3", "olmo2") else _LAYER
    for hf_name, tensor in state.items():
        array = tensor.float().numpy()
        if hf_name in _GLOBAL:
            out[_GLOBAL[hf_name]] = array
            continue
        match = _NAME.match(hf_name)
        assert match, hf_name
        layer, module, kind = int(match.group(1)), match.group(2), match.group(3)
        expert = _EXPERT.match(module)
        if expert:
            experts.setdefault((layer, expert.group(2)), {})[int(expert.group(1))] = array
            continue
        if arch in _QWEN35_ARCHS:
            gguf_module, array = _qwen35_tensor(module, array, cfg)
            suffix = {"ssm_a": "", "ssm_dt": ".bias"}.get(gguf_module, f".{kind}")
            out[f"blk.{layer}.{gguf_module}{suffix}"] = array
            continue
        name = f"blk.{layer}.{names[module]}.{kind}"
        if arch in _PERMUTED_ARCHS and module == "self_attn.q_proj":
            array = _permute(array, cfg.num_attention_heads)
        elif arch in _PERMUTED_ARCHS and module == "self_attn.k_proj":
            array = _permute(array, cfg.num_key_value_heads)
        if arch == "gemma3" and module.endswith("norm"):
            array = array + 1.0  # llama.cpp's Gemma converter stores 1 + w
        out[name] = array
    for (layer, part), by_index in experts.items():
        out[f"blk.{layer}.ffn_{part}_exps.weight"] = np.stack(
            [by_index[e] for e in sorted(by_index)]
        )
    return out


def write_family_gguf(
    path: Path, cfg: Any, spec: Any, vocab: Path, chat_template: str, *,
    hf_dir: Path | None = None, qtype: GGMLQuantizationType = GGMLQuantizationType.F32,
) -> None:
    """Write the model saved in ``hf_dir`` (default: ``hf/`` beside ``path``) as llama.cpp
    would convert it; matrices (and stacked experts) in ``qtype``."""
    from tests.family_fixtures import llama3_rope_freq_factors

    arch = spec.gguf_arch
    state = load_file(str((hf_dir or path.parent / "hf") / "model.safetensors"))
    if cfg.tie_word_embeddings:
        state.pop("lm_head.weight", None)
    writer = GGUFWriter(str(path), arch)
    _write_metadata(writer, cfg, arch)
    _copy_tokenizer(writer, vocab)
    writer.add_chat_template(chat_template)
    tensors = _layer_tensors(arch, cfg, state)
    rope = cfg.rope_parameters or {}
    if rope.get("rope_type") == "llama3":
        tensors["rope_freqs.weight"] = llama3_rope_freq_factors(cfg)
    if rope.get("rope_type") == "longrope":  # as llama.cpp's Phi-3 converter writes them
        tensors["rope_factors_long.weight"] = np.asarray(rope["long_factor"], dtype=np.float32)
        tensors["rope_factors_short.weight"] = np.asarray(rope["short_factor"], dtype=np.float32)
        writer.add_rope_scaling_orig_ctx_len(rope["original_max_position_embeddings"])
    if arch in ("gemma3", *_QWEN35_ARCHS):  # their norm weights include the 1 (converter adds it)
        tensors["output_norm.weight"] = tensors["output_norm.weight"] + 1.0
    for name, array in tensors.items():
        array = np.ascontiguousarray(array, dtype=np.float32)
        kept_f32 = arch in _QWEN35_ARCHS and name.endswith(_F32_TENSORS)
        if (qtype != GGMLQuantizationType.F32 and array.ndim >= 2 and array.shape[-1] % 32 == 0
                and not kept_f32):
            writer.add_tensor(name, quantize(array, qtype), raw_dtype=qtype)
        else:
            writer.add_tensor(name, array)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
