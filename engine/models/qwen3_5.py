"""Qwen3.5 / Qwen3.6 (dense and MoE): a hybrid of Gated DeltaNet linear attention (three layers
in four) and gated full attention (the fourth).

* **Linear-attention layers** (``linear_attn``): one fused projection to the conv inputs
  (q | k | v), the output gate z, and the per-head b (write strength) and a (decay); a depthwise
  causal conv + SiLU over the q/k/v inputs; q and k l2-normalised; the gated delta rule
  (kernels/torch_cpu/gated_delta.py, natively on CPU where the library builds); an RMSNorm of
  each head's output gated by ``silu(z)``; the output projection. Each sequence carries a
  fixed-size state (the conv window and a ``[Hv, Dk, Dv]`` matrix per layer) in the runner's
  state pool, addressed by ``ForwardBatch.recurrent``; the layer reads it, and the new state
  (and the checkpoints the cache asked for) are written back only once the whole forward has
  run, so a step that fails or is re-run for fault isolation never advances a state twice.
* **Full-attention layers**: q/k RMSNorm (``1 + w``) per head, partial rotary (the first
  quarter of each head; text positions make Qwen's multimodal RoPE the plain one), and the
  output multiplied by ``sigmoid(gate)``, whose rows HF stores interleaved with q's per head
  (split into ``self_attn.gate_proj`` at load). K/V go to the paged pool as for every family.
* Every other norm is ``1 + w``; the MoE variant adds a shared expert scaled by
  ``sigmoid(shared_expert_gate)`` beside the routed top-k.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping, Sequence
from typing import Any, NamedTuple

import torch
import torch.nn.functional as F

from prefixgate.engine.model_config import (
    LinearAttentionConfig,
    ModelConfig,
    UnsupportedModelError,
)
from prefixgate.engine.models.decoder import DecoderModel
from prefixgate.engine.models.forward_batch import ForwardBatch, RecurrentBatch
from prefixgate.engine.models.layers import DenseMLP, rms_norm
from prefixgate.engine.models.linear import Linear
from prefixgate.engine.models.moe import GroupedMoEMLP, MoEMLP
from prefixgate.engine.models.qwen3 import QK_NORM_TENSORS
from prefixgate.engine.models.qwen3_moe import stack_experts
from prefixgate.engine.models.registry import ModelFamily, register_family
from prefixgate.engine.models.weights import WeightPlacer
from prefixgate.kernels.quant import BLOCK, QuantizedTensor

_L2_EPS = 1e-6  # transformers' (and FLA's) l2norm epsilon


class _GatedAttention(NamedTuple):
    input_norm: Callable[[torch.Tensor], torch.Tensor]  # bound RMSNorm [T, H] -> [T, H]
    qkvg: Linear  # H -> Q + 2KV + Q (q, k, v, then the output gate)
    q_norm: torch.Tensor  # [D]
    k_norm: torch.Tensor  # [D]
    o: Linear  # Q -> H
    mlp_norm: Callable[[torch.Tensor], torch.Tensor]
    mlp: Any  # DenseMLP | MoEMLP | SharedExpertMoE


class _DeltaNet(NamedTuple):
    input_norm: Callable[[torch.Tensor], torch.Tensor]  # bound RMSNorm
    proj: Linear  # H -> C + Hv*Dv + 2Hv (conv inputs q|k|v, z, b, a)
    conv_weight: torch.Tensor  # [C, K]
    decay_rate: torch.Tensor  # [Hv] fp32, -exp(A_log)
    dt_bias: torch.Tensor  # [Hv] fp32
    out_norm: torch.Tensor  # [Dv], plain w (not 1 + w)
    out: Linear  # Hv*Dv -> H
    mlp_norm: Callable[[torch.Tensor], torch.Tensor]
    mlp: Any
    state: int  # index of this layer's state in the runner's state pool


class SharedExpertMoE(NamedTuple):
    """Routed experts plus a shared expert scaled by ``sigmoid(gate . x)`` (Qwen3.5-MoE)."""

    routed: MoEMLP | GroupedMoEMLP
    shared: DenseMLP
    gate: torch.Tensor  # [1, H]

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        shared = self.shared(x) * torch.sigmoid(x @ self.gate.t())
        return self.routed(x) + shared

    def add_to(self, x: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        return residual + self(x)


class RecurrentState(NamedTuple):
    """One linear layer's state pool (the runner's): ``conv [N, K - 1, C]``, ``matrix
    [N, Hv, Dk, Dv]``, fp32, one slot per live sequence and per checkpoint."""

    conv: torch.Tensor
    matrix: torch.Tensor


class HybridModel(DecoderModel):
    """A Qwen3.5 model: :class:`DecoderModel`'s loading, embeddings, MLPs and head, with the
    hybrid layers above. ``forward`` takes, per layer, ``(k_cache, v_cache)`` for a full
    layer and a :class:`RecurrentState` for a linear one (the runner builds that list from
    :meth:`layer_kinds`)."""

    def __init__(self, config: ModelConfig, weights: Mapping[str, torch.Tensor], **kwargs: Any) -> None:
        if config.linear_attention is None:
            raise UnsupportedModelError(f"{config.name}: a hybrid model needs linear_attention")
        self.linear = config.linear_attention
        self._num_states = 0
        super().__init__(config, weights, **kwargs)
        # the backend's conv and recurrence, bound once (native CPU kernels where they build)
        self.delta_ops = self.ops.gated_delta()
        self._recurrent = [kind == "recurrent" for kind in self.layer_kinds()]  # once, not per step

    def _bind_decode_step(self) -> None:  # type: ignore[override]
        return None  # its layers are not the dense stack's records: they run op by op

    def layer_kinds(self) -> list[str]:
        """Per layer ``"attention"`` (paged K/V) or ``"recurrent"`` (a state slot)."""
        return ["recurrent" if is_linear else "attention" for is_linear in self.linear.layers]

    # ---- loading -----------------------------------------------------------------------

    def _layer(self, place: WeightPlacer, index: int) -> Any:  # type: ignore[override]
        p = f"model.layers.{index}."
        if not self.linear.layers[index]:
            attn = p + "self_attn."
            return _GatedAttention(
                input_norm=self._bound_norm(place, p + "input_layernorm.weight"),
                qkvg=place.named_linear([attn + f"{n}_proj.weight" for n in ("q", "k", "v", "gate")]),
                q_norm=place.norm(attn + "q_norm.weight"),
                k_norm=place.norm(attn + "k_norm.weight"),
                o=place.named_linear([attn + "o_proj.weight"]),
                mlp_norm=self._bound_norm(place, p + "post_attention_layernorm.weight"),
                mlp=self._hybrid_mlp(place, p + "mlp."),
            )
        attn = p + "linear_attn."
        state, self._num_states = self._num_states, self._num_states + 1
        return _DeltaNet(
            input_norm=self._bound_norm(place, p + "input_layernorm.weight"),
            proj=place.named_linear([attn + f"in_proj_{n}.weight" for n in ("qkv", "z", "b", "a")]),
            conv_weight=place.place(place.weights[attn + "conv1d.weight"], torch.float32),
            decay_rate=-place.place(place.weights[attn + "A_log"], torch.float32).exp(),
            dt_bias=place.place(place.weights[attn + "dt_bias"], torch.float32),
            out_norm=place.place(place.weights[attn + "norm.weight"]),
            out=place.named_linear([attn + "out_proj.weight"]),
            mlp_norm=self._bound_norm(place, p + "post_attention_layernorm.weight"),
            mlp=self._hybrid_mlp(place, p + "mlp."),
            state=state,
        )

    def _hybrid_mlp(self, place: WeightPlacer, prefix: str) -> Any:
        mlp = self._mlp(place, prefix)
        if not self.config.shared_expert_intermediate_size:
            return mlp
        shared = prefix + "shared_expert."
        return SharedExpertMoE(
            routed=mlp,
            shared=DenseMLP(
                place.named_linear([shared + "gate_proj.weight", shared + "up_proj.weight"]),
                place.named_linear([shared + "down_proj.weight"]),
                self.ops.gated_activation(self.config.activation),
            ),  # fmt: skip
            gate=place.tensor(prefix + "shared_expert_gate.weight"),
        )

    # ---- the forward pass --------------------------------------------------------------

    def _gated_attention(self, layer: _GatedAttention, x: torch.Tensor, batch: ForwardBatch,
                         kv_cache: tuple[torch.Tensor, torch.Tensor],
                         cos_sin: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        cfg = self.config
        num_tokens, q_size, kv_size, head_dim = x.shape[0], cfg.q_size, cfg.kv_size, cfg.head_dim
        qkvg = layer.qkvg(x)  # [T, Q + 2KV + Q]
        q = rms_norm(qkvg[:, :q_size].reshape(num_tokens, -1, head_dim), layer.q_norm, cfg.rms_norm_eps)
        k = rms_norm(qkvg[:, q_size : q_size + kv_size].reshape(num_tokens, -1, head_dim),
                     layer.k_norm, cfg.rms_norm_eps)
        qk = self._rotate(torch.cat([q, k], 1), *cos_sin)  # [T, Hq + Hkv, D]
        v = qkvg[:, q_size + kv_size : q_size + 2 * kv_size].reshape(num_tokens, -1, head_dim)
        attn = batch.attention.forward(qk[:, : cfg.num_heads], qk[:, cfg.num_heads :], v,
                                       *kv_cache, self.scale, window=None)
        gate = qkvg[:, q_size + 2 * kv_size :]
        return attn.reshape(num_tokens, q_size) * torch.sigmoid(gate)

    def _delta_net(self, layer: _DeltaNet, x: torch.Tensor, recurrent: RecurrentBatch,
                   state: RecurrentState, updates: list[tuple[int, tuple[torch.Tensor, ...]]]
                   ) -> torch.Tensor:
        lin = self.linear
        num_tokens, channels = x.shape[0], lin.conv_channels
        hv, dk, dv = lin.num_value_heads, lin.key_dim, lin.value_dim
        proj = layer.proj(x)  # [T, C + Hv*Dv + 2Hv]
        mixed, z = proj[:, :channels], proj[:, channels : channels + hv * dv]
        b, a = proj[:, channels + hv * dv : channels + hv * dv + hv], proj[:, channels + hv * dv + hv :]
        slots, qsl, saves = recurrent.slots, recurrent.query_start_loc, recurrent.save_rows
        conv_out, conv_state, conv_saved = self.delta_ops.conv(
            mixed.float(), layer.conv_weight, state.conv, qsl, saves, state_slots=slots)
        key_width = lin.num_key_heads * dk
        q = conv_out[:, :key_width].reshape(num_tokens, lin.num_key_heads, dk)
        k = conv_out[:, key_width : 2 * key_width].reshape(num_tokens, lin.num_key_heads, dk)
        v = conv_out[:, 2 * key_width :].reshape(num_tokens, hv, dv)
        q = q * torch.rsqrt((q * q).sum(-1, keepdim=True) + _L2_EPS) * dk**-0.5
        k = k * torch.rsqrt((k * k).sum(-1, keepdim=True) + _L2_EPS)
        if hv != lin.num_key_heads:  # each q/k head serves consecutive value heads
            q = q.repeat_interleave(hv // lin.num_key_heads, dim=1)
            k = k.repeat_interleave(hv // lin.num_key_heads, dim=1)
        beta = torch.sigmoid(b.float())
        g = layer.decay_rate * F.softplus(a.float() + layer.dt_bias)
        out, matrix, matrix_saved = self.delta_ops.rule(
            q, k, v, g, beta, state.matrix, qsl, saves, state_slots=slots)
        updates.append((layer.state, (conv_state, matrix, conv_saved, matrix_saved)))
        # RMSNorm of each head's output, gated by silu(z) (the norm weight is plain w)
        normed = rms_norm(out.to(x.dtype), layer.out_norm, self.config.rms_norm_eps)
        gated = normed * F.silu(z.float().reshape(num_tokens, hv, dv)).to(x.dtype)
        return gated.reshape(num_tokens, hv * dv)

    @staticmethod
    def _write_states(recurrent: RecurrentBatch, states: Sequence[RecurrentState],
                      updates: list[tuple[int, tuple[torch.Tensor, ...]]]) -> None:
        """The step's new states and checkpoints, once the whole forward ran (see the module
        docstring)."""
        for index, (conv, matrix, conv_saved, matrix_saved) in updates:
            state = states[index]
            state.conv[recurrent.slots] = conv.to(state.conv.dtype)
            state.matrix[recurrent.slots] = matrix
            if recurrent.save_rows:
                state.conv[recurrent.save_slots] = conv_saved.to(state.conv.dtype)
                state.matrix[recurrent.save_slots] = matrix_saved

    @torch.inference_mode()
    def forward(self, batch: ForwardBatch, kv_caches: Sequence[Any]) -> torch.Tensor:  # type: ignore[override]
        """Run one step (``DecoderModel.forward``'s contract); ``kv_caches[i]`` is layer i's
        ``(k_cache, v_cache)`` or :class:`RecurrentState`."""
        recurrent = batch.recurrent
        if recurrent is None:
            raise ValueError("a hybrid model's step needs ForwardBatch.recurrent (state slots)")
        hidden = self._embed(batch.input_ids)  # [T, H]
        cos_sin = self.ropes[0].lookup(batch.positions)
        updates: list[tuple[int, tuple[torch.Tensor, ...]]] = []
        states = [c for c, recurrent in zip(kv_caches, self._recurrent, strict=True) if recurrent]
        for layer, cache in zip(self.layers, kv_caches, strict=True):
            x = layer.input_norm(hidden)
            if isinstance(layer, _DeltaNet):
                mixed = self._delta_net(layer, x, recurrent, cache, updates)
                hidden = layer.out.add_to(mixed, hidden)
            else:
                hidden = layer.o.add_to(self._gated_attention(layer, x, batch, cache, cos_sin), hidden)
            hidden = layer.mlp.add_to(layer.mlp_norm(hidden), hidden)
        last = self._final_norm(hidden.index_select(0, batch.logits_indices))
        logits = self.lm_head(last).float()
        self._write_states(recurrent, states, updates)
        return logits


# ---- the family ----------------------------------------------------------------------


def _hf_config(raw: dict[str, Any]) -> dict[str, Any]:
    layers = int(raw["num_hidden_layers"])
    types = raw.get("layer_types") or [
        "full_attention" if (i + 1) % int(raw.get("full_attention_interval", 4)) == 0
        else "linear_attention" for i in range(layers)
    ]
    unknown = sorted(set(types) - {"linear_attention", "full_attention"})
    if unknown:
        raise UnsupportedModelError(f"Qwen3.5 layer types {unknown} are not supported")
    rope = raw.get("rope_parameters") or {}
    head_dim = int(raw.get("head_dim") or int(raw["hidden_size"]) // int(raw["num_attention_heads"]))
    factor = float(rope.get("partial_rotary_factor", raw.get("partial_rotary_factor", 0.25)))
    extras: dict[str, Any] = {
        "norm_weight_offset": 1.0,
        "qk_norm": True,
        "attn_output_gate": True,
        "rotary_dim": int(head_dim * factor),
        "linear_attention": LinearAttentionConfig(
            layers=tuple(t == "linear_attention" for t in types),
            conv_kernel=int(raw.get("linear_conv_kernel_dim", 4)),
            num_key_heads=int(raw["linear_num_key_heads"]),
            num_value_heads=int(raw["linear_num_value_heads"]),
            key_dim=int(raw["linear_key_head_dim"]),
            value_dim=int(raw["linear_value_head_dim"]),
        ),
    }
    if raw.get("num_experts"):
        extras |= {
            "num_experts": int(raw["num_experts"]),
            "num_experts_per_tok": int(raw["num_experts_per_tok"]),
            "moe_intermediate_size": int(raw["moe_intermediate_size"]),
            "norm_topk_prob": True,  # Qwen3.5-MoE's router always renormalises the top-k
            "shared_expert_intermediate_size": int(raw.get("shared_expert_intermediate_size") or 0),
        }
    return extras


def _gguf_config(meta: Callable[..., Any]) -> dict[str, Any]:
    """llama.cpp's ``qwen35`` / ``qwen35moe`` keys (src/models/qwen35.cpp's hparams): the
    DeltaNet shape as ``ssm.*`` (K heads = group_count, V heads = time_step_rank, the key head
    dim = state_size, V heads x value head dim = inner_size), the recurrent layers as one bool
    per block or every ``full_attention_interval``-th block full; MTP blocks counted in
    ``block_count`` after the trunk are not run."""

    def need(key: str) -> int:
        value = meta(key)
        if value is None:
            raise UnsupportedModelError(f"a Qwen3.5 GGUF needs the metadata key {key!r}")
        return int(value)

    layers = need("block_count") - int(meta("nextn_predict_layers", 0))
    recurrent = meta("attention.recurrent_layers")
    if recurrent is None:
        every = int(meta("full_attention_interval", 4))
        recurrent = [(i + 1) % every != 0 for i in range(layers)]
    value_heads = need("ssm.time_step_rank")
    head_dim = int(meta("attention.key_length") or need("embedding_length") // need("attention.head_count"))
    extras: dict[str, Any] = {
        "num_layers": layers,
        "norm_weight_offset": 1.0,
        "qk_norm": True,
        "attn_output_gate": True,
        "rotary_dim": int(meta("rope.dimension_count", head_dim // 4)),
        "linear_attention": LinearAttentionConfig(
            layers=tuple(bool(r) for r in recurrent[:layers]),
            conv_kernel=need("ssm.conv_kernel"),
            num_key_heads=need("ssm.group_count"),
            num_value_heads=value_heads,
            key_dim=need("ssm.state_size"),
            value_dim=need("ssm.inner_size") // value_heads,
        ),
    }
    if meta("expert_count"):
        extras |= {
            "num_experts": need("expert_count"),
            "num_experts_per_tok": need("expert_used_count"),
            "moe_intermediate_size": need("expert_feed_forward_length"),
            "norm_topk_prob": True,
            # llama.cpp's default when the key is absent: the dense FFN length
            "shared_expert_intermediate_size": int(
                meta("expert_shared_feed_forward_length") or meta("feed_forward_length", 0)),
        }
    return extras


# llama.cpp's per-layer names (gguf-py's tensor_mapping.py for qwen35 / qwen35moe) -> HF's
_GGUF_TENSORS = {
    **QK_NORM_TENSORS,
    "post_attention_norm.weight": "post_attention_layernorm.weight",
    # a linear layer's in_proj_qkv; in a full layer (--fuse-qkv) q|gate, k, v: split below
    "attn_qkv.weight": "linear_attn.in_proj_qkv.weight",
    "attn_gate.weight": "linear_attn.in_proj_z.weight",
    "ssm_beta.weight": "linear_attn.in_proj_b.weight",
    "ssm_alpha.weight": "linear_attn.in_proj_a.weight",
    "ssm_conv1d.weight": "linear_attn.conv1d.weight",
    "ssm_dt.bias": "linear_attn.dt_bias",
    "ssm_a": "linear_attn.A_log",  # holds -exp(A_log): undone in _from_gguf
    "ssm_norm.weight": "linear_attn.norm.weight",
    "ssm_out.weight": "linear_attn.out_proj.weight",
    "ffn_gate_inp.weight": "mlp.gate.weight",
    "ffn_gate_exps.weight": "mlp.experts.gate_proj.weight",
    "ffn_up_exps.weight": "mlp.experts.up_proj.weight",
    "ffn_down_exps.weight": "mlp.experts.down_proj.weight",
    "ffn_gate_up_exps.weight": "mlp.experts.gate_up_proj",  # --fuse-gate-up-exps: gate rows first
    "ffn_gate_shexp.weight": "mlp.shared_expert.gate_proj.weight",
    "ffn_up_shexp.weight": "mlp.shared_expert.up_proj.weight",
    "ffn_down_shexp.weight": "mlp.shared_expert.down_proj.weight",
    "ffn_gate_inp_shexp.weight": "mlp.shared_expert_gate.weight",
    # the MTP blocks after the trunk: named so the file loads, then dropped
    **{f"nextn.{n}.weight": f"mtp.{n}.weight" for n in (
        "eh_proj", "enorm", "hnorm", "embed_tokens", "shared_head_head", "shared_head_norm")},
}
_LAYER_INDEX = re.compile(r"^model\.layers\.(\d+)\.")


def _rows(tensor: Any, index: torch.Tensor) -> Any:
    """Rows ``index`` of a tensor, fp32 or ggml blocks (whose rows are independent bytes)."""
    if isinstance(tensor, QuantizedTensor):
        return QuantizedTensor(tensor.qtype, tensor.data[index].contiguous(), (len(index), tensor.shape[1]))
    return tensor[index]


def _columns(tensor: Any, index: torch.Tensor) -> Any:
    """Columns ``index`` of a matrix; ggml blocks stay blocks where ``index`` moves whole
    32-column blocks (value heads of 128), else they are dequantized."""
    if not isinstance(tensor, QuantizedTensor):
        return tensor[:, index]
    runs = index.reshape(-1, BLOCK) if len(index) % BLOCK == 0 else None
    if runs is None or not torch.equal(runs - runs[:, :1], torch.arange(BLOCK).expand_as(runs)) \
            or bool((runs[:, 0] % BLOCK).any()):
        return tensor.dequantize()[:, index]
    rows = tensor.shape[0]
    blocks = tensor.data.reshape(rows, tensor.shape[1] // BLOCK, -1)[:, runs[:, 0] // BLOCK]
    return QuantizedTensor(tensor.qtype, blocks.reshape(rows, -1).contiguous(), tensor.shape)


def _grouped_heads(linear: LinearAttentionConfig, width: int) -> torch.Tensor:
    """Undoes llama.cpp's V-head tiling (its converter's ``_reorder_v_heads``, for fewer K heads
    than V heads): the tiled ``[V/K, K, width]`` back to HF's grouped ``[K, V/K, width]``."""
    per_key = linear.num_value_heads // linear.num_key_heads
    tiled = torch.arange(linear.num_value_heads * width).reshape(per_key, linear.num_key_heads, width)
    return tiled.transpose(0, 1).reshape(-1)


def _from_gguf(weights: dict[str, Any], config: Any) -> dict[str, Any]:
    """Undo llama.cpp's converter (conversion/qwen.py): norms stored as ``1 + w`` (but the
    DeltaNet's output norm), ``A_log`` stored as ``-exp(A_log)``, V heads tiled; a full layer's
    fused ``attn_qkv`` split; MTP blocks dropped. The q|gate rows stay interleaved per head as
    in HF's q_proj (llama.cpp's graph splits them too)."""
    linear = config.linear_attention
    key_width = 2 * linear.num_key_heads * linear.key_dim
    tiled = linear.num_key_heads != linear.num_value_heads
    value_rows, head_rows = _grouped_heads(linear, linear.value_dim), _grouped_heads(linear, 1)
    out: dict[str, Any] = {}
    for name, tensor in weights.items():
        match = _LAYER_INDEX.match(name)
        layer = int(match.group(1)) if match else None
        if layer is not None and layer >= config.num_layers:
            continue  # an MTP block
        if name.endswith("norm.weight") and not name.endswith("linear_attn.norm.weight"):
            # NOTE: exact: the model's 1 + (stored - 1) is the stored value (Sterbenz)
            tensor = tensor - 1.0
        elif name.endswith("linear_attn.A_log"):
            tensor = torch.log(-tensor.double()).float()
        if name.endswith("linear_attn.in_proj_qkv.weight") and not linear.layers[layer]:
            q, kv = 2 * config.q_size, config.kv_size
            for part, start, size in (("q", 0, q), ("k", q, kv), ("v", q + kv, kv)):
                out[name.replace("linear_attn.in_proj_qkv", f"self_attn.{part}_proj")] = _rows(
                    tensor, torch.arange(start, start + size))
            continue
        if tiled and ".linear_attn." in name:
            if name.endswith(("in_proj_qkv.weight", "conv1d.weight")):  # only the V rows
                tensor = _rows(tensor, torch.cat([torch.arange(key_width), key_width + value_rows]))
            elif name.endswith("in_proj_z.weight"):
                tensor = _rows(tensor, value_rows)
            elif name.endswith(("in_proj_a.weight", "in_proj_b.weight", "A_log", "dt_bias")):
                tensor = _rows(tensor, head_rows)
            elif name.endswith("out_proj.weight"):
                tensor = _columns(tensor, value_rows)
        if isinstance(tensor, QuantizedTensor) and name.endswith(
                ("conv1d.weight", "shared_expert_gate.weight")):
            tensor = tensor.dequantize()  # placed as plain tensors
        out[name] = tensor
    return out


def _split_weights(weights: dict[str, Any], config: Any, fmt: str) -> dict[str, Any]:
    """HF's per-head interleaved q|gate rows split into q_proj and gate_proj; the conv weight
    squeezed to ``[C, K]``; MoE experts stacked (per-expert tensors as Qwen3-MoE's, or
    transformers 5's fused ``gate_up_proj``). A GGUF's converter transforms are undone first
    (:func:`_from_gguf`); its Q4_0/Q4_1/Q8_0 matrices stay in their blocks (row splits and
    gathers are byte copies)."""
    if fmt == "gguf":
        weights = _from_gguf(weights, config)
    out: dict[str, Any] = {}
    heads, head_dim = config.num_heads, config.head_dim
    for name, tensor in weights.items():
        if name.endswith("self_attn.q_proj.weight") and tensor.shape[0] == 2 * config.q_size:
            rows = torch.arange(2 * config.q_size).reshape(heads, 2, head_dim)
            out[name] = _rows(tensor, rows[:, 0].reshape(-1))
            out[name.replace("q_proj", "gate_proj")] = _rows(tensor, rows[:, 1].reshape(-1))
        elif name.endswith("linear_attn.conv1d.weight") and tensor.dim() == 3:
            out[name] = tensor[:, 0]
        elif name.endswith("mlp.experts.gate_up_proj") and isinstance(tensor, QuantizedTensor):
            inter = config.moe_intermediate_size  # [E * 2I, H] in blocks, gate rows first
            gate = (torch.arange(config.num_experts)[:, None] * 2 * inter + torch.arange(inter)).reshape(-1)
            base = name.removesuffix("gate_up_proj")
            out[base + "gate_proj.weight"] = _rows(tensor, gate)
            out[base + "up_proj.weight"] = _rows(tensor, gate + inter)
        elif name.endswith("mlp.experts.gate_up_proj"):
            inter = tensor.shape[1] // 2
            base = name.removesuffix("gate_up_proj")
            out[base + "gate_proj.weight"] = tensor[:, :inter]
            out[base + "up_proj.weight"] = tensor[:, inter:]
        elif name.endswith("mlp.experts.down_proj"):
            out[name + ".weight"] = tensor
        else:
            out[name] = tensor
    return stack_experts(out, config, fmt) if config.num_experts else out


QWEN3_5 = register_family(
    ModelFamily(
        name="qwen3_5",
        model_class=HybridModel,
        hf_model_types=("qwen3_5_text", "qwen3_5_moe_text"),
        gguf_architectures=("qwen35", "qwen35moe"),
        hf_config=_hf_config,
        gguf_config=_gguf_config,
        gguf_tensors=_GGUF_TENSORS,
        adapt_weights=_split_weights,
    )
)
