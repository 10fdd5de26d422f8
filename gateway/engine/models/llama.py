"""Llama-family decoder (llama, mistral, qwen2, smollm2) over the paged KV cache.

Flat layout: every activation is ``[num_tokens, hidden]`` for the whole step (prefill chunks and
decode tokens of many sequences mixed); attention is the step's kernel backend
(``batch.attention``: K/V into the pages, then attention over them). Weights are fused once at
load (q|k|v and gate|up, one matmul each) and packed for the device's fastest GEMM
(models/linear.py); the per-layer loop touches a small record of tensors and nothing else, so
Python overhead stays a few ops per layer.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import NamedTuple

import torch
import torch.nn.functional as F

from prefixgate import kernels
from prefixgate.gateway.engine.model_config import ModelConfig, check_weights
from prefixgate.gateway.engine.models.forward_batch import ForwardBatch
from prefixgate.gateway.engine.models.linear import Linear, shared_linear
from prefixgate.gateway.engine.models.rope import RotaryEmbedding
from prefixgate.kernels.cpu.host_memory import HugePageArena
from prefixgate.kernels.cpu.ops import (
    quant_native_available,
    rms_norm_native,
    rope_native,
    silu_mul_native,
)
from prefixgate.kernels.quant import QuantizedTensor, cat_rows


class _Layer(NamedTuple):
    input_norm: torch.Tensor  # [H]
    qkv: Linear  # H -> Q + 2KV (+ bias for qwen2)
    o: Linear  # Q -> H, residual add fused
    post_norm: torch.Tensor  # [H]
    gate_up: Linear  # H -> 2I
    down: Linear  # I -> H, residual add fused


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, native: bool = False) -> torch.Tensor:
    """``weight * x / rms(x)`` over the last dim, computed in fp32 (as the reference does).

    ``native``: fp32 CPU rows go through one fused native pass when it is available.
    """
    if native:
        out = rms_norm_native(x, weight, eps)
        if out is not None:
            return out
    dtype = x.dtype
    x32 = x.float()
    x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return weight * x32.to(dtype)


def activation_dtype(device: torch.device, dtype: torch.dtype) -> torch.dtype:
    """What activations are computed in for a model of ``dtype`` on ``device``: ``dtype`` itself,
    except bf16 on CPU, whose activations stay fp32 (only the GEMMs' inputs are bf16: a bf16
    residual stream would round every layer's sum, and the fused CPU ops are fp32)."""
    if device.type == "cpu" and dtype == torch.bfloat16:
        return torch.float32
    return dtype


class LlamaModel:
    """Weights on ``device`` in ``dtype`` plus the forward pass.

    Args:
        config: the model's shape.
        weights: HF-named tensors, fp32 or ggml blocks (see ``LoadedModel``); read, not kept.
        device / dtype: where and in what precision to compute. bf16 on CPU is the mixed mode
            of docs/precision.md: the matrices in bf16 (GGUF blocks expanded to it), every
            activation, norm, RoPE and the attention in fp32 (:func:`activation_dtype`).
        max_positions: longest sequence to support (RoPE table size).
        kernel_backend: the runner's kernel backend name (the runner binds the backend
            object; a step brings it in ``ForwardBatch.attention``).
        native_ops: on CPU in fp32, run RMSNorm, SiLU-and-multiply, RoPE and the K/V write as
            fused native ops (kernels/cpu/ops.py) where the library builds; each falls
            back to its torch ops otherwise. Same math, fewer passes and dispatches.
    """

    def __init__(
        self,
        config: ModelConfig,
        weights: Mapping[str, torch.Tensor],
        *,
        device: torch.device | str = "cpu",
        dtype: torch.dtype = torch.float32,
        max_positions: int | None = None,
        kernel_backend: str | None = None,
        native_ops: bool = False,
        quantized_weights: bool = True,
    ) -> None:
        check_weights(config, weights, source=config.name)
        self.config = config
        self.device = torch.device(device)
        self.dtype = dtype
        # norms, biases, RoPE, the residual stream
        self.act_dtype = act = activation_dtype(self.device, dtype)
        # resolved once: a per-call resolution reads the environment 60 times a step
        self.kernel_backend = kernels.backend_name(self.device, kernel_backend)
        self.native_ops = native_ops
        self.scale = config.head_dim**-0.5

        # ggml-block matrices (GGUF) stay in their blocks where the native kernel computes
        # (CPU fp32); anywhere else they are dequantized here, exactly
        quantized = (
            quantized_weights
            and native_ops
            and self.device.type == "cpu"
            and dtype == torch.float32
            and quant_native_available()
        )

        def put(tensor: torch.Tensor | QuantizedTensor, to: torch.dtype = act) -> torch.Tensor:
            if isinstance(tensor, QuantizedTensor):
                tensor = tensor.dequantize()
            return tensor.to(device=self.device, dtype=to).contiguous()

        def matrix(parts: list[torch.Tensor | QuantizedTensor]) -> torch.Tensor | QuantizedTensor:
            """The parts stacked by rows (fused q|k|v, gate|up), in blocks when they can be."""
            first = parts[0]
            if quantized and all(
                isinstance(t, QuantizedTensor) and t.qtype == first.qtype for t in parts
            ):
                return parts[0] if len(parts) == 1 else cat_rows(parts)  # type: ignore[arg-type]
            if len(parts) == 1:
                return put(parts[0], dtype)
            return torch.cat([put(t, dtype) for t in parts])

        # packed native weights sit in huge pages, in the order a step reads them
        arena = HugePageArena() if native_ops and self.device.type == "cpu" else None

        def linear(
            parts: list[torch.Tensor | QuantizedTensor], bias_parts: Sequence[torch.Tensor] = ()
        ) -> Linear:
            def build() -> Linear:
                bias = put(torch.cat(list(bias_parts))) if bias_parts else None
                return Linear(matrix(parts), bias, native=native_ops, arena=arena)

            # fp32 layers are not shared (None): hundreds of MB each would stay alive
            flags = (self.device, dtype, native_ops) if quantized else None
            return shared_linear([*parts, *bias_parts], flags, build)

        embed_name = "model.embed_tokens.weight"
        embed = matrix([weights[embed_name]])
        self.lm_head = linear([weights[embed_name if config.tie_word_embeddings else "lm_head.weight"]])
        # [V, H], or None: rows gathered from the blocks of embed_rows (the tied LM head's when
        # tied), so no fp32 table (113 MB for SmolLM2) is kept
        self.embed: torch.Tensor | None = embed if isinstance(embed, torch.Tensor) else None
        self.embed_rows: Linear | None = None
        if self.embed is None:
            self.embed_rows = linear([weights[embed_name]])  # the LM head itself when tied
        self.final_norm = put(weights["model.norm.weight"])
        self.layers: list[_Layer] = []
        for layer in range(config.num_layers):
            p = f"model.layers.{layer}."
            attn, mlp = p + "self_attn.", p + "mlp."
            bias = [weights[attn + f"{n}_proj.bias"] for n in "qkv"] if config.attention_bias else []
            o_bias = [weights[attn + "o_proj.bias"]] if config.attention_out_bias else []
            qkv = [weights[attn + f"{n}_proj.weight"] for n in "qkv"]
            gate_up = [weights[mlp + "gate_proj.weight"], weights[mlp + "up_proj.weight"]]
            self.layers.append(
                _Layer(
                    input_norm=put(weights[p + "input_layernorm.weight"]),
                    qkv=linear(qkv, bias),
                    o=linear([weights[attn + "o_proj.weight"]], o_bias),
                    post_norm=put(weights[p + "post_attention_layernorm.weight"]),
                    gate_up=linear(gate_up),
                    down=linear([weights[mlp + "down_proj.weight"]]),
                )
            )
        self.max_positions = max_positions or config.max_position_embeddings
        self.rope = RotaryEmbedding(config, self.max_positions, self.device, act)

    @torch.inference_mode()
    def forward(
        self, batch: ForwardBatch, kv_caches: Sequence[tuple[torch.Tensor, torch.Tensor]]
    ) -> torch.Tensor:
        """Run one step; write every token's K/V into its slot; return logits.

        Args:
            batch: flat tokens and attention addressing (on this model's device).
            kv_caches: per layer ``(k_cache, v_cache)``, each ``[num_pages, page_size, Hkv, D]``.

        Returns:
            ``[len(batch.logits_indices), vocab]`` fp32 logits of the selected rows.
        """
        cfg = self.config
        num_tokens = batch.input_ids.shape[0]
        q_size, kv_size, head_dim = cfg.q_size, cfg.kv_size, cfg.head_dim
        inter = cfg.intermediate_size
        eps = cfg.rms_norm_eps
        attention = batch.attention
        cos, sin = self.rope.lookup(batch.positions)  # [T, 1, D/2] each, shared by all layers

        native = self.native_ops
        if self.embed is not None:
            # a bf16 table (CPU bf16 mode) widens its rows into the fp32 residual stream
            hidden = F.embedding(batch.input_ids, self.embed).to(self.act_dtype)  # [T, H]
        else:
            assert self.embed_rows is not None
            hidden = self.embed_rows.rows(batch.input_ids)  # [T, H]
        for layer, (k_cache, v_cache) in zip(self.layers, kv_caches, strict=True):
            x = rms_norm(hidden, layer.input_norm, eps, native)
            qkv = layer.qkv(x)  # [T, Q + 2KV]
            # q and k rotate together: one set of elementwise ops for both (in place natively:
            # qkv is this layer's fresh output)
            qk = qkv[:, : q_size + kv_size].view(num_tokens, -1, head_dim)  # [T, Hq + Hkv, D]
            if not (native and rope_native(qk, cos, sin)):
                qk = self.rope.rotate(qk, cos, sin)
            q, k = qk[:, : cfg.num_heads], qk[:, cfg.num_heads :]  # [T, Hq, D], [T, Hkv, D]
            v = qkv[:, q_size + kv_size :].view(num_tokens, cfg.num_kv_heads, head_dim)
            # K/V into the pages, then attention over them; the layout is checked on the first
            # layer of the step only (every layer's caches are views of one pool)
            attn = attention.forward(q, k, v, k_cache, v_cache, self.scale)  # [T, Hq, D]
            hidden = layer.o.add_to(attn.reshape(num_tokens, q_size), hidden)
            x = rms_norm(hidden, layer.post_norm, eps, native)
            gate_up = layer.gate_up(x)  # [T, 2I]
            act = silu_mul_native(gate_up) if native else None
            if act is None:
                act = F.silu(gate_up[:, :inter]) * gate_up[:, inter:]  # [T, I]
            hidden = layer.down.add_to(act, hidden)

        # only the rows that sample pay for the final norm and the vocab projection
        last = hidden.index_select(0, batch.logits_indices)  # [N, H]
        last = rms_norm(last, self.final_norm, eps, native)
        return self.lm_head(last).float()  # [N, V]
