"""A configurable pre-norm decoder for the families beyond Llama: Qwen3, Qwen3-MoE, Gemma 3.

What differs from models/llama.py is read from :class:`ModelConfig` once, at load:
q/k RMSNorm per head, Gemma's ``1 + w`` norms, sandwich norms (after attention and after the
MLP), GeGLU, the embedding scale, final logit softcapping, sliding-window layers with their own
RoPE base, and a mixture-of-experts MLP. Every layer writes its K/V into the same paged pool;
a sliding layer reads it through a window mask (kernels/sliding_window.py), so prefix hits,
copy-on-write and shared pages behave as for full layers.

Flat layout as llama.py: activations ``[num_tokens, hidden]`` for the whole step.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from typing import NamedTuple

import torch
import torch.nn.functional as F

from prefixgate import kernels
from prefixgate.gateway.engine.model_config import ModelConfig, check_weights
from prefixgate.gateway.engine.models.forward_batch import ForwardBatch
from prefixgate.gateway.engine.models.linear import Linear
from prefixgate.gateway.engine.models.llama import rms_norm
from prefixgate.gateway.engine.models.moe import MoEMLP, StackedExperts
from prefixgate.gateway.engine.models.rope import RotaryEmbedding
from prefixgate.kernels.cpu.ops import quant_native_available
from prefixgate.kernels.quant import QuantizedTensor, cat_rows
from prefixgate.kernels.sliding_window import paged_attention_windowed


class DenseMLP(NamedTuple):
    gate_up: Linear  # H -> 2I (gate rows first)
    down: Linear  # I -> H
    activation: str  # "silu" or "gelu_tanh"

    def __call__(self, x: torch.Tensor) -> torch.Tensor:  # [T, H] -> [T, H]
        gate_up = self.gate_up(x)  # [T, 2I]
        inter = gate_up.shape[1] // 2
        gate = gate_up[:, :inter]
        act = F.silu(gate) if self.activation == "silu" else F.gelu(gate, approximate="tanh")
        return self.down(act * gate_up[:, inter:])


class _Layer(NamedTuple):
    input_norm: torch.Tensor  # [H]
    qkv: Linear  # H -> Q + 2KV
    q_norm: torch.Tensor | None  # [D], per head
    k_norm: torch.Tensor | None  # [D]
    o: Linear  # Q -> H
    attn_out_norm: torch.Tensor | None  # [H], sandwich norm on the attention output
    mlp_norm: torch.Tensor  # [H]
    mlp: DenseMLP | MoEMLP
    mlp_out_norm: torch.Tensor | None  # [H], sandwich norm on the MLP output
    window: int | None  # sliding layers: tokens visible (itself included)
    rope: int  # index into DecoderModel.ropes


class DecoderModel:
    """Weights on ``device`` in ``dtype`` plus the forward pass (same arguments as LlamaModel).

    Quantized GGUF matrices (Q4_0/Q4_1/Q8_0) stay in their ggml blocks where the native CPU
    kernel computes (fp32, ``native_ops``, ``quantized_weights``), as in llama.py; elsewhere,
    and for embeddings and MoE experts, they are dequantized here (exactly).
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
        self.kernel_backend = kernels.backend_name(self.device, kernel_backend)
        self.native_ops = native_ops
        self.quantized = (
            quantized_weights
            and native_ops
            and self.device.type == "cpu"
            and dtype == torch.float32
            and quant_native_available()
        )
        self.scale = config.attention_scale
        self.max_positions = max_positions or config.max_position_embeddings
        self._weights = weights
        self.embed = self._put("model.embed_tokens.weight")
        head = "model.embed_tokens.weight" if config.tie_word_embeddings else "lm_head.weight"
        self.lm_head = self._linear(self._matrix([head]))
        self.final_norm = self._norm_weight("model.norm.weight")
        self.ropes = [RotaryEmbedding(config, self.max_positions, self.device, dtype)]
        if config.rope_local_theta is not None:
            local = dataclasses.replace(
                config, rope_theta=config.rope_local_theta, rope_scaling=None,
                rope_freq_factors=None,
            )  # fmt: skip
            self.ropes.append(RotaryEmbedding(local, self.max_positions, self.device, dtype))
        self.layers = [self._layer(index) for index in range(config.num_layers)]
        del self._weights

    # ---- loading -----------------------------------------------------------------------

    def _put(self, name: str) -> torch.Tensor:
        return self._place(self._weights[name])

    def _place(self, tensor: torch.Tensor | QuantizedTensor | StackedExperts) -> torch.Tensor:
        if isinstance(tensor, QuantizedTensor | StackedExperts):
            tensor = tensor.dequantize()
        return tensor.to(device=self.device, dtype=self.dtype).contiguous()

    def _matrix(self, names: list[str]) -> torch.Tensor | QuantizedTensor:
        """The named matrices stacked by rows (fused q|k|v, gate|up), in blocks when they can be."""
        return self._join([self._weights[name] for name in names])

    def _join(self, parts: list[torch.Tensor | QuantizedTensor]) -> torch.Tensor | QuantizedTensor:
        if self.quantized and all(
            isinstance(t, QuantizedTensor) and t.qtype == parts[0].qtype for t in parts
        ):
            return parts[0] if len(parts) == 1 else cat_rows(parts)  # type: ignore[arg-type]
        return torch.cat([self._place(t) for t in parts])

    def _expert_parts(self, name: str) -> list[torch.Tensor | QuantizedTensor]:
        stacked = self._weights[name]  # [E, rows, cols]: in blocks per expert, or a tensor
        return list(stacked.parts) if isinstance(stacked, StackedExperts) else list(stacked)

    def _norm_weight(self, name: str) -> torch.Tensor:
        # Gemma's norms scale by 1 + w (in fp32, as the reference); folded in once here
        weight = self._weights[name]
        assert isinstance(weight, torch.Tensor)
        weight = weight.float() + self.config.norm_weight_offset
        return weight.to(device=self.device, dtype=self.dtype).contiguous()

    def _linear(
        self, weight: torch.Tensor | QuantizedTensor, bias: torch.Tensor | None = None
    ) -> Linear:
        return Linear(weight, bias, native=self.native_ops and self.device.type == "cpu")

    def _optional_norm(self, name: str, present: bool) -> torch.Tensor | None:
        return self._norm_weight(name) if present else None

    def _layer(self, index: int) -> _Layer:
        cfg = self.config
        p = f"model.layers.{index}."
        attn, mlp = p + "self_attn.", p + "mlp."
        qkv = self._matrix([attn + f"{n}_proj.weight" for n in "qkv"])
        qkv_bias = (
            torch.cat([self._put(attn + f"{n}_proj.bias") for n in "qkv"])
            if cfg.attention_bias
            else None
        )
        o_bias = self._put(attn + "o_proj.bias") if cfg.attention_out_bias else None
        sandwich = cfg.sandwich_norms
        window = cfg.layer_window(index)
        return _Layer(
            input_norm=self._norm_weight(p + "input_layernorm.weight"),
            qkv=self._linear(qkv, qkv_bias),
            q_norm=self._optional_norm(attn + "q_norm.weight", cfg.qk_norm),
            k_norm=self._optional_norm(attn + "k_norm.weight", cfg.qk_norm),
            o=self._linear(self._matrix([attn + "o_proj.weight"]), o_bias),
            attn_out_norm=self._optional_norm(p + "post_attention_layernorm.weight", sandwich),
            mlp_norm=self._norm_weight(
                p
                + (
                    "pre_feedforward_layernorm.weight"
                    if sandwich
                    else "post_attention_layernorm.weight"
                )
            ),  # fmt: skip
            mlp=self._mlp(mlp),
            mlp_out_norm=self._optional_norm(p + "post_feedforward_layernorm.weight", sandwich),
            window=window,
            rope=1 if window is not None and len(self.ropes) > 1 else 0,
        )

    def _mlp(self, prefix: str) -> DenseMLP | MoEMLP:
        cfg = self.config
        if cfg.num_experts:
            gates, ups, downs = (
                self._expert_parts(f"{prefix}experts.{n}_proj.weight") for n in ("gate", "up", "down")
            )
            experts = [
                (self._linear(self._join([gate, up])), self._linear(self._join([down])))
                for gate, up, down in zip(gates, ups, downs, strict=True)
            ]
            return MoEMLP(
                self._put(prefix + "gate.weight"),
                experts,
                top_k=cfg.num_experts_per_tok,
                normalize=cfg.norm_topk_prob,
            )
        gate_up = self._matrix([prefix + "gate_proj.weight", prefix + "up_proj.weight"])
        return DenseMLP(
            self._linear(gate_up), self._linear(self._matrix([prefix + "down_proj.weight"])),
            cfg.activation,
        )  # fmt: skip

    # ---- the forward pass --------------------------------------------------------------

    def _norm(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, weight, self.config.rms_norm_eps, self.native_ops)

    def _attention(
        self,
        layer: _Layer,
        x: torch.Tensor,
        batch: ForwardBatch,
        kv_cache: tuple[torch.Tensor, torch.Tensor],
        cos_sin: tuple[torch.Tensor, torch.Tensor],
        check: bool,
    ) -> torch.Tensor:  # [T, Q]
        cfg = self.config
        num_tokens = x.shape[0]
        q_size, kv_size, head_dim = cfg.q_size, cfg.kv_size, cfg.head_dim
        qkv = layer.qkv(x)  # [T, Q + 2KV]
        q = qkv[:, :q_size].view(num_tokens, cfg.num_heads, head_dim)  # [T, Hq, D]
        k = qkv[:, q_size : q_size + kv_size].view(num_tokens, cfg.num_kv_heads, head_dim)
        v = qkv[:, q_size + kv_size :].view(num_tokens, cfg.num_kv_heads, head_dim)
        if layer.q_norm is not None and layer.k_norm is not None:
            q = rms_norm(q, layer.q_norm, cfg.rms_norm_eps)
            k = rms_norm(k, layer.k_norm, cfg.rms_norm_eps)
        q, k = self._rotate(q, cos_sin), self._rotate(k, cos_sin)
        k_cache, v_cache = kv_cache
        kernels.write_kv(
            k, v, k_cache, v_cache, batch.slot_mapping, backend=self.kernel_backend, check=check
        )
        addressing = (k_cache, v_cache, batch.block_tables, batch.seq_lens, batch.query_start_loc)
        if layer.window is not None:
            attn = paged_attention_windowed(q, *addressing, self.scale, layer.window, check=check)
        else:
            attn = kernels.paged_attention(
                q, *addressing, self.scale, max_query_len=batch.max_query_len,
                backend=self.kernel_backend, plan=batch.attention_plan, check=check,
            )  # fmt: skip
        return attn.reshape(num_tokens, q_size)

    def _rotate(
        self, x: torch.Tensor, cos_sin: tuple[torch.Tensor, torch.Tensor]
    ) -> torch.Tensor:  # [T, H, D]
        rotary = self.config.rotary_dim
        if rotary is None or rotary == x.shape[-1]:
            return RotaryEmbedding.rotate(x, *cos_sin)
        # partial rotary (Phi-4-mini): the first dims turn, the rest pass through
        return torch.cat((RotaryEmbedding.rotate(x[..., :rotary], *cos_sin), x[..., rotary:]), -1)

    def _embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        hidden = F.embedding(input_ids, self.embed)  # [T, H]
        if self.config.embedding_scale is not None:
            hidden = hidden * torch.tensor(self.config.embedding_scale, dtype=hidden.dtype)
        return hidden

    @torch.inference_mode()
    def forward(
        self, batch: ForwardBatch, kv_caches: Sequence[tuple[torch.Tensor, torch.Tensor]]
    ) -> torch.Tensor:
        """Run one step; write every token's K/V into its slot; return ``[N, V]`` fp32 logits."""
        hidden = self._embed(batch.input_ids)
        rope_tables = [rope.lookup(batch.positions) for rope in self.ropes]  # [T, 1, D/2] each
        for index, (layer, kv_cache) in enumerate(zip(self.layers, kv_caches, strict=True)):
            x = self._norm(hidden, layer.input_norm)
            attn = self._attention(layer, x, batch, kv_cache, rope_tables[layer.rope], index == 0)
            if layer.attn_out_norm is None:
                hidden = layer.o.add_to(attn, hidden)
            else:
                hidden = hidden + self._norm(layer.o(attn), layer.attn_out_norm)
            x = self._norm(hidden, layer.mlp_norm)
            out = layer.mlp(x)
            if layer.mlp_out_norm is not None:
                out = self._norm(out, layer.mlp_out_norm)
            hidden = hidden + out
        last = self._norm(hidden.index_select(0, batch.logits_indices), self.final_norm)  # [N, H]
        logits = self.lm_head(last).float()  # [N, V]
        cap = self.config.final_logit_softcapping
        if cap:
            logits = torch.tanh(logits / cap) * cap
        return logits


__all__ = ["DecoderModel", "DenseMLP"]
