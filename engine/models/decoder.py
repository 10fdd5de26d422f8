"""The pre-norm decoder every family runs on: Llama (llama, mistral, smollm2, qwen2), Qwen3,
Qwen3-MoE, Gemma 3 and Phi-3/Phi-4-mini are configurations of this one model class.

What a family changes is read from :class:`ModelConfig` once, at load: attention biases, q/k
RMSNorm per head, Gemma's ``1 + w`` norms, sandwich norms (after attention and after the MLP),
GeGLU, the embedding scale, final logit softcapping, partial rotary, sliding-window layers with
their own RoPE base, a mixture-of-experts MLP, layers without RoPE (SmolLM3's NoPE), post-norm
blocks with q/k norms over whole projections (OLMo 2), and Granite's attention, residual and
logit multipliers. Every layer writes its K/V into the same
paged pool through the step's kernel backend (``batch.attention``, bound once at runner start);
a sliding layer passes its window to that same call, so prefix hits, copy-on-write and shared
pages behave as for full layers.

Flat layout: every activation is ``[num_tokens, hidden]`` for the whole step (prefill chunks
and decode tokens of many sequences mixed). Weights are fused once at load (q|k|v and gate|up,
one matmul each) and packed for the device's fastest GEMM (models/weights.py); the per-layer
loop touches a small record of tensors and nothing else, so Python overhead stays a few ops
per layer. Every norm, activation, RoPE and linear layer holds the op the kernel registry
(kernels/layer_ops.py) bound for it at load: on CPU in fp32 the fused native ops where the
library builds, torch ops otherwise; nothing is chosen again per step.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping, Sequence
from functools import partial
from typing import NamedTuple

import torch
import torch.nn.functional as F

from prefixgate.engine.model_config import ModelConfig, check_weights
from prefixgate.engine.models.forward_batch import ForwardBatch
from prefixgate.engine.models.gpt_oss_moe import GptOssMoE, load_gpt_oss_moe
from prefixgate.engine.models.layers import DenseMLP, activation_dtype
from prefixgate.engine.models.linear import Linear
from prefixgate.engine.models.moe import GroupedMoEMLP, MoEMLP
from prefixgate.engine.models.rope import RotaryEmbedding
from prefixgate.engine.models.weights import WeightPlacer
from prefixgate.kernels.layer_ops import DenseDecodeStep, DenseLayerOps, KernelChoice, LayerOps

Op = Callable[[torch.Tensor], torch.Tensor]


class _Layer(NamedTuple):
    """One layer's weights, each norm bound to its op ([T, H] -> [T, H]) at load."""

    input_norm: Op | None  # None: no pre-norm (OLMo 2)
    qkv: Linear  # H -> Q + 2KV (+ bias for qwen2)
    qk_norm: Op | None  # [T, Hq + Hkv, D] -> same
    o: Linear  # Q -> H
    attn_out_norm: Op | None  # sandwich norm on the attention output
    mlp_norm: Op | None  # None: no pre-norm (OLMo 2)
    mlp: DenseMLP | MoEMLP | GptOssMoE
    mlp_out_norm: Op | None  # sandwich norm on the MLP output
    window: int | None  # sliding layers: tokens visible (itself included)
    rope: int | None  # index into DecoderModel.ropes; None: no RoPE (a NoPE layer)
    sinks: torch.Tensor | None = None  # [Hq] fp32 attention-sink logits (gpt-oss)


class DecoderModel:
    """Weights on ``device`` in ``dtype`` plus the forward pass.

    Args:
        config: the model's shape and its family's options.
        weights: HF-named tensors, fp32 or ggml blocks (see ``LoadedModel``); read, not kept.
        device / dtype: where and in what precision to compute. bf16 on CPU is the mixed mode
            of docs/precision.md: the matrices in bf16 (GGUF blocks expanded to it), every
            activation, norm, RoPE and the attention in fp32 (:func:`activation_dtype`).
        max_positions: longest sequence to support (RoPE table size).
        kernels: the runner's kernel choice (kernels/layer_ops.py): its backend (the runner
            binds the attention backend object, a step brings it in ``ForwardBatch.attention``;
            an MoE model binds the backend's grouped experts op here, except with the native
            CPU ops: one native linear layer per expert, blocks kept; None: the per-expert
            layers); ``native``: on CPU in fp32 RMSNorm, SiLU-and-multiply, RoPE, the linear
            layers and the K/V write run natively where the library builds;
            ``quantized_weights``: ggml-block matrices stay in their blocks where the native
            kernel computes them (MoE experts included, embeddings too: their rows are
            gathered from the blocks); ``int8_activations``: the q8 mode (docs/precision.md),
            those block matrices take int8 inputs; ``int8_layers`` counts them. Every layer's
            ops are bound from it here, once (``self.ops``).
    """

    def __init__(
        self,
        config: ModelConfig,
        weights: Mapping[str, torch.Tensor],
        *,
        device: torch.device | str = "cpu",
        dtype: torch.dtype = torch.float32,
        max_positions: int | None = None,
        kernels: KernelChoice = KernelChoice(),
    ) -> None:
        check_weights(config, weights, source=config.name)
        self.config = config
        self.device = torch.device(device)
        self.dtype = dtype
        # norms, biases, RoPE, the residual stream
        self.act_dtype = activation_dtype(self.device, dtype)
        self.kernels = kernels
        self.kernel_backend = kernels.backend
        self.native_ops = kernels.native
        # the kernel registry: every layer's op is bound through it below, once
        self.ops = LayerOps(kernels, self.device, self.act_dtype, dtype)
        self.scale = config.attention_scale
        # the head split, read once (the config's sizes are computed properties)
        self._heads = (config.q_size, config.kv_size, config.head_dim, config.num_heads,
                       config.num_kv_heads)
        self.residual_scale = config.residual_scale  # Granite; None: 1
        self.max_positions = max_positions or config.max_position_embeddings
        place = WeightPlacer(
            weights, device=self.device, dtype=dtype, act_dtype=self.act_dtype, ops=self.ops,
            norm_weight_offset=config.norm_weight_offset,
        )  # fmt: skip
        self._load_embeddings(place)
        self.final_norm = place.norm("model.norm.weight")  # [H]
        self._final_norm = self.ops.rms_norm(self.final_norm, config.rms_norm_eps)
        self.ropes = self._ropes()
        # every layer's heads turn alike: one RoPE op for the model
        self._rotate = self.ops.rope(config.head_dim, config.rotary_dim)
        self.layers = [self._layer(place, index) for index in range(config.num_layers)]
        self.int8_layers = place.int8_layers  # linear layers on int8 activations (q8 mode)
        # every layer of a decode step in one native call, where all of them fit it
        self.decode_step: DenseDecodeStep | None = self._bind_decode_step()
        self._step_rotates = self.decode_step is not None and any(
            layer.rope is not None for layer in self.layers)

    # ---- loading -----------------------------------------------------------------------

    def _load_embeddings(self, place: WeightPlacer) -> None:
        name = "model.embed_tokens.weight"
        head = name if self.config.tie_word_embeddings else "lm_head.weight"
        self.lm_head = place.named_linear([head])
        embed = place.matrix([place.weights[name]])
        # [V, H], or None: rows gathered from the blocks of embed_rows (the tied LM head's when
        # tied, the same layer), so no fp32 table (113 MB for SmolLM2) is kept
        self.embed: torch.Tensor | None = embed if isinstance(embed, torch.Tensor) else None
        self.embed_rows = place.named_linear([name]) if self.embed is None else None

    def _ropes(self) -> list[RotaryEmbedding]:
        """The global layers' RoPE, then the local (sliding) layers' own base, if any."""
        cfg = self.config
        ropes = [RotaryEmbedding(cfg, self.max_positions, self.device, self.act_dtype)]
        if cfg.rope_local_theta is not None:
            local = dataclasses.replace(
                cfg, rope_theta=cfg.rope_local_theta, rope_scaling=None, rope_freq_factors=None
            )
            ropes.append(RotaryEmbedding(local, self.max_positions, self.device, self.act_dtype))
        return ropes

    def _layer(self, place: WeightPlacer, index: int) -> _Layer:
        cfg = self.config
        p = f"model.layers.{index}."
        attn = p + "self_attn."
        qkv_bias = [attn + f"{n}_proj.bias" for n in "qkv"] if cfg.attention_bias else []
        o_bias = [attn + "o_proj.bias"] if cfg.attention_out_bias else []
        sandwich, pre = cfg.sandwich_norms, cfg.pre_norms
        window = cfg.layer_window(index)
        rope: int | None = 1 if window is not None and len(self.ropes) > 1 else 0
        if cfg.rope_layers is not None and not cfg.rope_layers[index]:
            rope = None
        norm = partial(self._bound_norm, place)
        mlp_norm = None
        if pre:
            mlp_norm = norm(
                p + ("pre_feedforward_layernorm.weight" if sandwich
                     else "post_attention_layernorm.weight")
            )  # fmt: skip
        return _Layer(
            input_norm=norm(p + "input_layernorm.weight") if pre else None,
            qkv=place.named_linear([attn + f"{n}_proj.weight" for n in "qkv"], qkv_bias),
            qk_norm=self._qk_norm(place, attn) if cfg.qk_norm else None,
            o=place.named_linear([attn + "o_proj.weight"], o_bias),
            attn_out_norm=norm(p + "post_attention_layernorm.weight") if sandwich else None,
            mlp_norm=mlp_norm,
            mlp=self._mlp(place, p + "mlp."),
            mlp_out_norm=norm(p + "post_feedforward_layernorm.weight") if sandwich else None,
            window=window,
            rope=rope,
            sinks=place.place(place.weights[attn + "sinks"], torch.float32)
            if cfg.attention_sinks else None,
        )

    def _bind_decode_step(self) -> DenseDecodeStep | None:
        """The registry's whole-step decode for a plain pre-norm dense stack (per-head q/k
        norms or none; no sandwich norms, windows, sinks, residual scale or MoE; one RoPE table, or
        none per layer), or None: the layers then run op by op."""
        cfg = self.config
        ropes = {layer.rope for layer in self.layers}
        if (self.residual_scale is not None or not ropes <= {0, None} or any(
                layer.input_norm is None or layer.mlp_norm is None
                or layer.attn_out_norm is not None or layer.mlp_out_norm is not None
                or layer.window is not None or layer.sinks is not None
                or not isinstance(layer.mlp, DenseMLP) for layer in self.layers)):
            return None
        layers = [DenseLayerOps(layer.input_norm, layer.qkv.op, layer.o.op, layer.mlp_norm,
                                layer.mlp.gate_up.op, layer.mlp.act, layer.mlp.down.op,
                                rotate=layer.rope is not None, qk_norm=layer.qk_norm)
                  for layer in self.layers]
        rope = self._rotate if 0 in ropes else None
        return self.ops.dense_decode_step(
            layers, rope, hidden=cfg.hidden_size, num_heads=cfg.num_heads,
            num_kv_heads=cfg.num_kv_heads, head_dim=cfg.head_dim, eps=cfg.rms_norm_eps,
            scale=self.scale)

    def _bound_norm(self, place: WeightPlacer, name: str) -> Op:
        """The RMSNorm of weight ``name``, bound to the registry's op for it."""
        return self.ops.rms_norm(place.norm(name), self.config.rms_norm_eps)

    def _qk_norm(self, place: WeightPlacer, attn: str) -> Op:
        cfg = self.config
        q_norm, k_norm = place.norm(attn + "q_norm.weight"), place.norm(attn + "k_norm.weight")
        if cfg.qk_norm_full:  # OLMo 2: one RMS over each token's whole q, another over its k
            return partial(_norm_q_and_k, q_norm=self.ops.rms_norm(q_norm, cfg.rms_norm_eps),
                           k_norm=self.ops.rms_norm(k_norm, cfg.rms_norm_eps),
                           q_size=q_norm.shape[0])
        # q and k heads are normed (and rotated) together, one op over the [T, Hq + Hkv, D] view
        return self.ops.head_norm(q_norm, k_norm, cfg.rms_norm_eps, cfg.num_heads,
                                  cfg.num_kv_heads)

    def _mlp(self, place: WeightPlacer, prefix: str) -> DenseMLP | MoEMLP | GptOssMoE:
        cfg = self.config
        if cfg.swiglu_limit is not None:  # gpt-oss's biased, clamped experts
            return load_gpt_oss_moe(place, prefix, top_k=cfg.num_experts_per_tok,
                                    alpha=cfg.swiglu_alpha, limit=cfg.swiglu_limit)
        if not cfg.num_experts:
            return DenseMLP(
                place.named_linear([prefix + "gate_proj.weight", prefix + "up_proj.weight"]),
                place.named_linear([prefix + "down_proj.weight"]),
                self.ops.gated_activation(cfg.activation),
            )  # fmt: skip
        router = place.tensor(prefix + "gate.weight")
        routing = {"top_k": cfg.num_experts_per_tok, "normalize": cfg.norm_topk_prob}
        names = [f"{prefix}experts.{n}_proj.weight" for n in ("gate", "up", "down")]
        op = self.ops.moe_experts()
        if op is not None:
            # the backend's grouped op over the stacked experts, bound once here
            gate, up, down = (place.place(place.weights[n], self.dtype) for n in names)
            return GroupedMoEMLP(router, torch.cat([gate, up], 1), down, op, **routing)
        # the native CPU linear layers, one per expert (ggml blocks kept as they are)
        gates, ups, downs = (place.expert_parts(n) for n in names)
        experts = [
            (place.linear([gate, up]), place.linear([down]))
            for gate, up, down in zip(gates, ups, downs, strict=True)
        ]
        return MoEMLP(router, experts, **routing)

    # ---- the forward pass --------------------------------------------------------------

    def _embed(self, input_ids: torch.Tensor) -> torch.Tensor:  # [T] -> [T, H]
        if self.embed is not None:
            # a bf16 table (CPU bf16 mode) widens its rows into the fp32 residual stream
            hidden = F.embedding(input_ids, self.embed).to(self.act_dtype)
        else:
            assert self.embed_rows is not None
            hidden = self.embed_rows.rows(input_ids)
        if self.config.embedding_scale is not None:
            hidden = hidden * torch.tensor(self.config.embedding_scale, dtype=hidden.dtype)
        return hidden

    def _attention(
        self,
        layer: _Layer,
        x: torch.Tensor,  # [T, H]
        batch: ForwardBatch,
        kv_cache: tuple[torch.Tensor, torch.Tensor],
        cos_sin: tuple[torch.Tensor, torch.Tensor] | None,  # None: a NoPE layer
    ) -> torch.Tensor:  # [T, Q]
        num_tokens = x.shape[0]
        q_size, kv_size, head_dim, num_heads, num_kv_heads = self._heads
        qkv = layer.qkv(x)  # [T, Q + 2KV]
        # q and k are normed and rotated together: one set of elementwise ops for both
        qk = qkv[:, : q_size + kv_size].view(num_tokens, -1, head_dim)  # [T, Hq + Hkv, D]
        if layer.qk_norm is not None:
            qk = layer.qk_norm(qk)
        if cos_sin is not None:
            qk = self._rotate(qk, *cos_sin)
        q, k = qk[:, :num_heads], qk[:, num_heads:]  # [T, Hq, D], [T, Hkv, D]
        v = qkv[:, q_size + kv_size :].view(num_tokens, num_kv_heads, head_dim)
        # K/V into the pages, then attention over them (the step's backend, bound once)
        attn = batch.attention.forward(q, k, v, *kv_cache, self.scale, window=layer.window,
                                       sinks=layer.sinks)  # sinks: gpt-oss
        return attn.reshape(num_tokens, q_size)

    def _layers(
        self, hidden: torch.Tensor, rope_tables: list[tuple[torch.Tensor, torch.Tensor]],
        batch: ForwardBatch, kv_caches: Sequence[tuple[torch.Tensor, torch.Tensor]],
    ) -> torch.Tensor:  # [T, H] -> [T, H]
        """Every layer, op by op (each op the registry bound at load)."""
        scale = self.residual_scale
        for layer, kv_cache in zip(self.layers, kv_caches, strict=True):
            x = hidden if layer.input_norm is None else layer.input_norm(hidden)
            cos_sin = None if layer.rope is None else rope_tables[layer.rope]
            attn = self._attention(layer, x, batch, kv_cache, cos_sin)
            if layer.attn_out_norm is None:
                # residual add fused into the GEMM; Granite's scale on its input (no o bias)
                hidden = layer.o.add_to(attn if scale is None else attn * scale, hidden)
            else:
                hidden = hidden + layer.attn_out_norm(layer.o(attn))
            x = hidden if layer.mlp_norm is None else layer.mlp_norm(hidden)
            if layer.mlp_out_norm is None and scale is None:
                hidden = layer.mlp.add_to(x, hidden)
            elif layer.mlp_out_norm is None:
                hidden = torch.add(hidden, layer.mlp(x), alpha=scale)
            else:
                hidden = hidden + layer.mlp_out_norm(layer.mlp(x))
        return hidden

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
        hidden = self._embed(batch.input_ids)  # [T, H]
        rope_tables = [rope.lookup(batch.positions) for rope in self.ropes]  # [T, 1, D/2] each
        step, plan = self.decode_step, batch.attention_plan
        if (step is not None and batch.recurrent is None
                and step.accepts(hidden.shape[0], plan, kv_caches[0][0].dtype)):
            # the one table of every rotating layer (the step binds only then)
            cos_sin = rope_tables[0] if self._step_rotates else None
            hidden = step.run(hidden.contiguous(), cos_sin, batch.slot_mapping,
                              batch.block_tables, plan, kv_caches)
        else:
            hidden = self._layers(hidden, rope_tables, batch, kv_caches)
        # only the rows that sample pay for the final norm and the vocab projection
        last = self._final_norm(hidden.index_select(0, batch.logits_indices))  # [N, H]
        logits = self.lm_head(last).float()  # [N, V]
        cap = self.config.final_logit_softcapping
        if cap:
            logits = torch.tanh(logits / cap) * cap
        if self.config.logits_scaling is not None:  # Granite
            logits = logits / self.config.logits_scaling
        return logits


def _norm_q_and_k(qk: torch.Tensor, *, q_norm: Op, k_norm: Op, q_size: int) -> torch.Tensor:
    """OLMo 2's q/k norms (bound ops): RMS over all of a token's q (weight ``[Hq * D]``), and
    over all of its k (``[Hkv * D]``), not per head. ``qk [T, Hq + Hkv, D]`` -> same."""
    num_tokens, _, head_dim = qk.shape
    flat = qk.reshape(num_tokens, -1)  # [T, Q + KV]: rows of unit column stride
    normed = torch.cat([q_norm(flat[:, :q_size]), k_norm(flat[:, q_size:])], dim=-1)
    return normed.view(num_tokens, -1, head_dim)


__all__ = ["DecoderModel", "DenseMLP"]
