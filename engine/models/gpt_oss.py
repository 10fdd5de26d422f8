"""gpt-oss (20b, 120b): attention with sinks, sliding (128) and full layers alternating, YaRN
RoPE, biased q/k/v/o projections, and a mixture of experts with a biased router and clamped
SwiGLU experts (models/gpt_oss_moe.py).

Attention sinks are one learned logit per query head that joins every row's softmax and takes
its share of the probability mass, attending nothing: the decoder hands each layer's
``self_attn.sinks`` to the step's attention backend with the layer's window (kernels/backend.py).

HF checkpoints (bf16, as transformers saves the random fixtures) store the experts as
``mlp.experts.gate_up_proj [E, H, 2I]`` (gate and up interleaved column by column),
``down_proj [E, I, H]`` and their biases, the router as ``mlp.router``; they are rewritten at
load into the stacked ``mlp.experts.{gate,up,down}_proj.weight`` (+ ``.bias``) and
``mlp.gate.weight`` / ``.bias`` the MoE families share. llama.cpp's ``gpt-oss`` GGUFs carry the
experts already split and stacked (``ffn_{gate,up,down}_exps`` + ``.bias``), the sinks as
``attn_sinks``, no layer pattern (llama.cpp fixes it: even layers slide) and no YaRN
``truncate`` (HF's gpt-oss config says false: the loader follows HF, as the logits test
against transformers shows). MXFP4 experts (HF's ``*_blocks`` / ``*_scales`` with
``quant_method: mxfp4``, as the released checkpoints ship; ggml type MXFP4 in GGUF) stay in
their blocks (``Mxfp4Experts``, kernels/torch_cpu/mxfp4.py) and run on the native MXFP4 kernel
(models/gpt_oss_moe.py); other quantization methods are refused with a clear error.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from prefixgate.engine.model_config import RopeScaling, UnsupportedModelError
from prefixgate.engine.models.decoder import DecoderModel
from prefixgate.engine.models.registry import ModelFamily, register_family
from prefixgate.kernels.layer_ops import Mxfp4Experts, Mxfp4Tensor
from prefixgate.kernels.quant import QuantizedTensor

_LAYER_TYPES = {"sliding_attention": "sliding", "full_attention": "full"}


def _hf_config(raw: dict[str, Any]) -> dict[str, Any]:
    layers = int(raw["num_hidden_layers"])
    types = raw.get("layer_types") or [
        "sliding_attention" if i % 2 == 0 else "full_attention" for i in range(layers)]
    unknown = sorted(set(types) - set(_LAYER_TYPES))
    if unknown:
        raise UnsupportedModelError(f"gpt-oss layer types {unknown} are not supported")
    method = (raw.get("quantization_config") or {}).get("quant_method")
    if method not in (None, "mxfp4"):
        raise UnsupportedModelError(
            f"gpt-oss quantized with {method!r} is not supported; bf16/fp32 checkpoints and "
            "MXFP4 experts (quant_method 'mxfp4', as openai/gpt-oss-20b and -120b ship) are")
    return {
        "layer_types": tuple(_LAYER_TYPES[t] for t in types),
        "sliding_window": int(raw.get("sliding_window") or 128),
        "num_experts": int(raw["num_local_experts"]),
        "num_experts_per_tok": int(raw["num_experts_per_tok"]),
        "moe_intermediate_size": int(raw["intermediate_size"]),
        "attention_sinks": True,
        "swiglu_alpha": float(raw.get("swiglu_alpha", 1.702)),
        "swiglu_limit": float(raw.get("swiglu_limit", 7.0)),
    }


def _gguf_config(meta: Callable[..., Any]) -> dict[str, Any]:
    layers = int(meta("block_count"))
    config: dict[str, Any] = {
        "layer_types": tuple("sliding" if i % 2 == 0 else "full" for i in range(layers)),
        "sliding_window": int(meta("attention.sliding_window", 128)),
        "num_experts": int(meta("expert_count", 0)),
        "num_experts_per_tok": int(meta("expert_used_count", 0)),
        "moe_intermediate_size": int(meta("expert_feed_forward_length", 0)),
        "attention_sinks": True,
        "swiglu_limit": 7.0,  # llama.cpp's gpt-oss graph fixes both constants
        "swiglu_alpha": 1.702,
    }
    if meta("rope.scaling.type") == "yarn":
        original = meta("rope.scaling.original_context_length")
        config["rope_scaling"] = RopeScaling(
            kind="yarn", factor=float(meta("rope.scaling.factor")),
            original_max_position_embeddings=int(original) if original else None,
            beta_fast=float(meta("rope.scaling.yarn_beta_fast", 32.0)),
            beta_slow=float(meta("rope.scaling.yarn_beta_slow", 1.0)), truncate=False)
    return config


def _plain(tensor: Any) -> torch.Tensor:
    return tensor.dequantize() if isinstance(tensor, QuantizedTensor) else tensor


def _mxfp4_hf(weights: dict[str, Any], out: dict[str, Any]) -> None:
    """HF's MXFP4 experts (``*_blocks`` / ``*_scales``, kernels/torch_cpu/mxfp4.py) kept in
    blocks: ``gate_up`` rows interleave gate (even) and up (odd), whole rows of blocks, so the
    split is a row slice; ``down`` is already ``[E, H, I]``."""
    for name in [n for n in weights if n.endswith("_proj_blocks")]:
        stem, part = name.rsplit(".", 1)  # "...mlp.experts", "gate_up_proj_blocks"
        proj = part.removesuffix("_blocks")
        scales = weights.get(f"{stem}.{proj}_scales")
        if scales is None:
            raise UnsupportedModelError(f"{name} has no {proj}_scales beside it")
        experts = Mxfp4Experts.from_hf(weights[name], scales)
        if proj == "gate_up_proj":
            for target, first in (("gate_proj", 0), ("up_proj", 1)):
                out[f"{stem}.{target}.weight"] = Mxfp4Experts(
                    tuple(e.rows(slice(first, None, 2)) for e in experts))
        else:
            out[f"{stem}.{proj}.weight"] = experts


def _adapt_hf(weights: dict[str, Any], config: Any, fmt: str) -> dict[str, Any]:
    if fmt != "hf":  # a GGUF's MXFP4 experts arrive as one [E * rows, cols] block matrix
        return {name: Mxfp4Experts.from_rows(t, config.num_experts)
                if isinstance(t, Mxfp4Tensor) and ".experts." in name else t
                for name, t in weights.items()}  # fmt: skip
    out: dict[str, Any] = {}
    _mxfp4_hf(weights, out)
    for name, tensor in weights.items():
        if name.endswith(("_proj_blocks", "_proj_scales")):
            continue
        if ".mlp.router." in name:
            out[name.replace(".mlp.router.", ".mlp.gate.")] = tensor
        elif name.endswith(".mlp.experts.gate_up_proj"):  # [E, H, 2I], gate|up interleaved
            stem = name.removesuffix("gate_up_proj")
            gate_up = _plain(tensor)
            out[stem + "gate_proj.weight"] = gate_up[..., 0::2].transpose(1, 2).contiguous()
            out[stem + "up_proj.weight"] = gate_up[..., 1::2].transpose(1, 2).contiguous()
        elif name.endswith(".mlp.experts.gate_up_proj_bias"):  # [E, 2I]
            stem = name.removesuffix("gate_up_proj_bias")
            out[stem + "gate_proj.bias"] = tensor[..., 0::2].contiguous()
            out[stem + "up_proj.bias"] = tensor[..., 1::2].contiguous()
        elif name.endswith(".mlp.experts.down_proj"):  # [E, I, H]
            out[name + ".weight"] = _plain(tensor).transpose(1, 2).contiguous()
        elif name.endswith(".mlp.experts.down_proj_bias"):
            out[name.removesuffix("_bias") + ".bias"] = tensor
        else:
            out[name] = tensor
    return out


GPT_OSS = register_family(
    ModelFamily(
        name="gpt_oss",
        model_class=DecoderModel,
        hf_model_types=("gpt_oss",),
        gguf_architectures=("gpt-oss",),
        hf_config=_hf_config,
        gguf_config=_gguf_config,
        gguf_tensors={
            "attn_sinks.weight": "self_attn.sinks",
            "post_attention_norm.weight": "post_attention_layernorm.weight",
            "ffn_gate_inp.weight": "mlp.gate.weight",
            "ffn_gate_inp.bias": "mlp.gate.bias",
            **{f"ffn_{part}_exps.{kind}": f"mlp.experts.{part}_proj.{kind}"
               for part in ("gate", "up", "down") for kind in ("weight", "bias")},
        },
        adapt_weights=_adapt_hf,
    )
)
