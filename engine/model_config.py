"""What the engine needs to know about a model's shape, in one frozen record.

Both loaders (GGUF metadata, HF ``config.json``) produce a :class:`ModelConfig`; the model code
and the runner read only this, never the file formats.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

# The Llama-family architectures (models/llama.py registers them with the rest).
# Values: does the file store q/k/v biases.
# GGUF and HF spell them the same way; "smollm2" is plain llama.
SUPPORTED_ARCHITECTURES: dict[str, bool] = {
    "llama": False,
    "mistral": False,
    "smollm2": False,
    "qwen2": True,
}

# RoPE scaling variants the model applies (besides none). "dynamic" (NTK) is not supported:
# it changes the rotation of already-cached keys as the sequence grows, which a shared paged
# cache cannot honour.
SUPPORTED_ROPE_SCALING = ("linear", "llama3", "yarn", "longrope")


class UnsupportedModelError(ValueError):
    """The file describes something this engine does not run (architecture, quant type...)."""


@dataclass(frozen=True, slots=True)
class RopeScaling:
    """Parameters of a RoPE scaling variant (HF ``rope_scaling`` / GGUF ``rope.scaling.*``)."""

    kind: str  # one of SUPPORTED_ROPE_SCALING
    factor: float
    original_max_position_embeddings: int | None = None
    low_freq_factor: float = 1.0  # llama3
    high_freq_factor: float = 4.0  # llama3
    beta_fast: float = 32.0  # yarn
    beta_slow: float = 1.0  # yarn
    attention_factor: float | None = None  # yarn; None = derived from factor (and mscales)
    mscale: float | None = None  # yarn
    mscale_all_dim: float | None = None  # yarn
    truncate: bool = True  # yarn: round the correction range to whole dims
    # longrope (Phi-3.5 / Phi-4-mini): per-pair divisors for contexts up to the original
    # length; the context is capped there (the long factors would re-rotate cached keys)
    short_factor: tuple[float, ...] | None = None

    def __post_init__(self) -> None:
        if self.kind not in SUPPORTED_ROPE_SCALING:
            raise UnsupportedModelError(
                f"RoPE scaling {self.kind!r} is not supported; supported: "
                f"{', '.join(SUPPORTED_ROPE_SCALING)} (or none)"
            )
        if self.factor <= 0:
            raise UnsupportedModelError(f"RoPE scaling factor must be > 0, got {self.factor}")
        if self.kind == "longrope" and self.short_factor is None:
            raise UnsupportedModelError("RoPE scaling 'longrope' needs short_factor")
        if self.kind in ("llama3", "yarn", "longrope") and not self.original_max_position_embeddings:
            raise UnsupportedModelError(
                f"RoPE scaling {self.kind!r} needs original_max_position_embeddings"
            )


MAX_ROPE_FACTOR = 64.0  # --rope-scaling: past this the positions mean nothing to the model


def parse_rope_override(text: str) -> tuple[str, float]:
    """``"yarn:4"`` → ``("yarn", 4.0)`` (``--rope-scaling``); ``linear`` and ``yarn`` only
    (llama3 needs frequency bands only its own checkpoints define).

    Raises:
        ValueError: naming the accepted form.
    """
    kind, sep, factor_text = text.strip().partition(":")
    try:
        factor = float(factor_text) if sep else float("nan")
    except ValueError:
        factor = float("nan")
    if kind not in ("linear", "yarn") or not 1.0 < factor <= MAX_ROPE_FACTOR:
        raise ValueError(f"--rope-scaling must be linear:FACTOR or yarn:FACTOR with FACTOR in "
                         f"(1, {MAX_ROPE_FACTOR:g}], got {text!r}")
    return kind, factor


def with_rope_override(config: ModelConfig, kind: str, factor: float) -> ModelConfig:
    """The model stretched past its trained context: RoPE scaled ``kind`` by ``factor`` over
    the trained length, and a context ``factor`` times longer (llama.cpp's ``--rope-scaling``
    / ``--rope-scale``, vLLM's ``--hf-overrides rope_scaling``). A model that already scales
    its RoPE is stretched from its own original length, by the product of the two factors."""
    own = config.rope_scaling
    original = config.max_position_embeddings
    if own is not None:
        original = own.original_max_position_embeddings or int(original / own.factor)
        factor *= own.factor
    scaling = RopeScaling(kind, factor, original_max_position_embeddings=original)
    return dataclasses.replace(config, rope_scaling=scaling,
                               max_position_embeddings=int(original * factor))


@dataclass(frozen=True, slots=True)
class LinearAttentionConfig:
    """A hybrid model's linear-attention (Gated DeltaNet) layers: their shape, and which layers
    they are. Each keeps a fixed-size recurrent state per sequence instead of per-token K/V:
    a conv window of ``conv_kernel - 1`` inputs and a ``[value_heads, key_dim, value_dim]``
    matrix (the state cache, docs/models.md)."""

    layers: tuple[bool, ...]  # per layer: True = linear attention, False = full attention
    conv_kernel: int
    num_key_heads: int
    num_value_heads: int
    key_dim: int  # per head
    value_dim: int  # per head

    @property
    def conv_channels(self) -> int:
        """Width of the conv's input: q, k and v of every head."""
        return 2 * self.num_key_heads * self.key_dim + self.num_value_heads * self.value_dim

    @property
    def state_numel(self) -> int:
        """fp32 values of one sequence's state in one linear layer (conv window + matrix)."""
        conv = (self.conv_kernel - 1) * self.conv_channels
        return conv + self.num_value_heads * self.key_dim * self.value_dim


@dataclass(frozen=True, slots=True)
class ModelConfig:
    """Shape and numerics of a decoder of any registered family (models/registry.py); the
    fields after ``rope_freq_factors`` are what the families beyond Llama add."""

    architecture: str
    name: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    max_position_embeddings: int  # the model's context length
    tie_word_embeddings: bool
    attention_bias: bool  # q/k/v projections carry a bias (qwen2; llama with attention_bias)
    rope_scaling: RopeScaling | None = None
    attention_out_bias: bool = False  # o_proj carries a bias (llama with attention_bias)
    # llama.cpp's per-dimension frequency divisors (GGUF ``rope_freqs.weight``), [head_dim / 2]
    rope_freq_factors: tuple[float, ...] | None = None

    # --- what other families add (defaults: the Llama family) ---
    qk_norm: bool = False  # RMSNorm over each q and k head before RoPE (qwen3, gemma3)
    norm_weight_offset: float = 0.0  # Gemma stores norm weights as offsets from 1
    activation: str = "silu"  # the MLP gate's activation: "silu" or "gelu_tanh" (GeGLU)
    embedding_scale: float | None = None  # Gemma multiplies embeddings by sqrt(hidden)
    sandwich_norms: bool = False  # Gemma: norms after attention and after the MLP too
    final_logit_softcapping: float | None = None  # logits = cap * tanh(logits / cap)
    query_pre_attn_scalar: float | None = None  # attention scale = this ** -0.5 (else head_dim)
    sliding_window: int | None = None  # tokens a sliding layer sees, itself included
    layer_types: tuple[str, ...] | None = None  # per layer "sliding" or "full" (None: all full)
    rope_local_theta: float | None = None  # RoPE base of the sliding layers (Gemma 3)
    num_experts: int = 0  # MoE: experts per layer (0: a dense MLP)
    num_experts_per_tok: int = 0  # MoE: the router's top-k
    moe_intermediate_size: int = 0  # MoE: one expert's hidden width
    norm_topk_prob: bool = True  # MoE: renormalise the top-k router weights to sum to 1
    rotary_dim: int | None = None  # partial rotary: RoPE turns only the first dims of a head
    # hybrid models (Qwen3.5): which layers are linear attention, and their shape
    linear_attention: LinearAttentionConfig | None = None
    attn_output_gate: bool = False  # attention output * sigmoid(gate), gate rows in q_proj
    shared_expert_intermediate_size: int = 0  # MoE: a gated shared expert beside the routed
    rope_layers: tuple[bool, ...] | None = None  # per layer: RoPE on (SmolLM3's NoPE layers off)
    pre_norms: bool = True  # False (OLMo 2): no norm before attention / MLP, the post norms only
    qk_norm_full: bool = False  # OLMo 2: q/k RMSNorm over each token's whole q and whole k
    attention_multiplier: float | None = None  # Granite: the softmax scale itself
    residual_scale: float | None = None  # Granite: attention / MLP outputs scaled before the add
    logits_scaling: float | None = None  # Granite: logits divided by this
    attention_sinks: bool = False  # gpt-oss: a learned logit per q head in every softmax
    # gpt-oss's experts: a biased router (softmax over the top-k logits), biased experts with
    # a clamped SwiGLU ``(clamp(up) + 1) * g * sigmoid(alpha * g)``, ``g = min(gate, limit)``
    swiglu_limit: float | None = None
    swiglu_alpha: float = 1.702

    def __post_init__(self) -> None:
        # the families register their architectures (models/registry.py)
        from prefixgate.engine.models.registry import require_architecture

        require_architecture(self.architecture)
        if self.activation not in ("silu", "gelu_tanh"):
            raise UnsupportedModelError(
                f"activation {self.activation!r} is not supported; supported: silu, gelu_tanh"
            )
        linear_layers = self.linear_attention.layers if self.linear_attention else None
        for name, per_layer in (("layer_types", self.layer_types), ("rope_layers", self.rope_layers),
                                ("linear_attention.layers", linear_layers)):
            if per_layer is not None and len(per_layer) != self.num_layers:
                raise UnsupportedModelError(
                    f"{name} has {len(per_layer)} entries for {self.num_layers} layers")
        if self.layer_types and "sliding" in self.layer_types and not self.sliding_window:
            raise UnsupportedModelError("sliding layers need a sliding_window")
        if self.rotary_dim is not None and not (0 < self.rotary_dim <= self.head_dim
                                                and self.rotary_dim % 2 == 0):
            raise UnsupportedModelError(
                f"rotary_dim must be even and in 1..{self.head_dim}, got {self.rotary_dim}"
            )
        if not self.pre_norms and not self.sandwich_norms:
            raise UnsupportedModelError("a model without pre-norms needs the post norms")
        if self.residual_scale is not None and (self.attention_out_bias or self.sandwich_norms):
            # NOTE: the decoder scales the attention output before o_proj, which a bias breaks
            raise UnsupportedModelError(
                "residual_scale with an o_proj bias or sandwich norms is not supported"
            )
        if self.num_experts and not 0 < self.num_experts_per_tok <= self.num_experts:
            raise UnsupportedModelError(
                f"num_experts_per_tok must be in 1..{self.num_experts}, "
                f"got {self.num_experts_per_tok}"
            )
        for field_name in ("vocab_size", "hidden_size", "intermediate_size", "num_layers",
                           "num_heads", "num_kv_heads", "head_dim", "max_position_embeddings"):
            value = getattr(self, field_name)
            if value <= 0:
                raise UnsupportedModelError(f"{field_name} must be positive, got {value}")
        if self.num_heads % self.num_kv_heads:
            raise UnsupportedModelError(
                f"num_heads ({self.num_heads}) must be a multiple of num_kv_heads "
                f"({self.num_kv_heads})"
            )
        if self.head_dim % 2:
            raise UnsupportedModelError(f"head_dim must be even for RoPE, got {self.head_dim}")
        rotary = self.rotary_dim or self.head_dim
        if self.rope_freq_factors is not None and len(self.rope_freq_factors) != rotary // 2:
            raise UnsupportedModelError(
                f"rope_freq_factors has {len(self.rope_freq_factors)} entries, expected "
                f"rotary dims / 2 = {rotary // 2}"
            )

    @property
    def attention_scale(self) -> float:
        """The softmax scale of q.k."""
        if self.attention_multiplier is not None:
            return self.attention_multiplier
        return (self.query_pre_attn_scalar or self.head_dim) ** -0.5

    def layer_window(self, layer: int) -> int | None:
        """How many tokens layer ``layer`` attends to (itself included); None: all."""
        if self.layer_types is None or self.layer_types[layer] != "sliding":
            return None
        return self.sliding_window

    @property
    def q_size(self) -> int:
        """Width of the query projection output (all heads)."""
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        """Width of the key (or value) projection output (all KV heads)."""
        return self.num_kv_heads * self.head_dim

    @property
    def attention_context_scale(self) -> int:
        """Context length at which one token's attention FLOPs equal its linear-layer FLOPs.

        Per layer a token costs ``2 * params`` in its projections and MLP, and
        ``4 * context * q_size`` in attention (QK and PV). The scheduler counts a prefill
        chunk's attention in these units, so a step's budget bounds its compute, not just its
        token count (3,072 for SmolLM2-135M: a 56-token suffix over 2,200 cached tokens costs
        like 97 context-free tokens).
        """
        hidden = self.hidden_size
        params = hidden * (self.q_size + 2 * self.kv_size) + self.q_size * hidden
        params += 3 * hidden * self.intermediate_size
        return max(1, params // (2 * self.q_size))


def expected_weight_shapes(config: ModelConfig) -> dict[str, tuple[int, ...]]:
    """HF parameter name -> shape, for every tensor a Llama-family model of ``config`` needs."""
    h, q, kv = config.hidden_size, config.q_size, config.kv_size
    shapes: dict[str, tuple[int, ...]] = {
        "model.embed_tokens.weight": (config.vocab_size, h),
        "model.norm.weight": (h,),
    }
    if not config.tie_word_embeddings:
        shapes["lm_head.weight"] = (config.vocab_size, h)
    for layer in range(config.num_layers):
        prefix = f"model.layers.{layer}."
        linear = config.linear_attention
        if linear is not None and linear.layers[layer]:
            shapes |= _linear_attention_shapes(config, linear, prefix)
            continue
        if config.pre_norms:
            shapes[prefix + "input_layernorm.weight"] = (h,)
        shapes |= {
            prefix + "post_attention_layernorm.weight": (h,),
            prefix + "self_attn.q_proj.weight": (q, h),
            prefix + "self_attn.k_proj.weight": (kv, h),
            prefix + "self_attn.v_proj.weight": (kv, h),
            prefix + "self_attn.o_proj.weight": (h, q),
        }
        shapes |= _family_layer_shapes(config, prefix)
        if config.attention_bias:
            shapes |= {
                prefix + "self_attn.q_proj.bias": (q,),
                prefix + "self_attn.k_proj.bias": (kv,),
                prefix + "self_attn.v_proj.bias": (kv,),
            }
        if config.attention_out_bias:
            shapes[prefix + "self_attn.o_proj.bias"] = (h,)
    return shapes


def _linear_attention_shapes(config: ModelConfig, linear: LinearAttentionConfig,
                             prefix: str) -> dict[str, tuple[int, ...]]:
    """A linear-attention layer of a hybrid model (Gated DeltaNet), its norms and MLP."""
    h, heads = config.hidden_size, linear.num_value_heads
    values = heads * linear.value_dim
    attn = prefix + "linear_attn."
    return {
        prefix + "input_layernorm.weight": (h,),
        prefix + "post_attention_layernorm.weight": (h,),
        attn + "in_proj_qkv.weight": (linear.conv_channels, h),
        attn + "in_proj_z.weight": (values, h),
        attn + "in_proj_b.weight": (heads, h),
        attn + "in_proj_a.weight": (heads, h),
        attn + "conv1d.weight": (linear.conv_channels, linear.conv_kernel),
        attn + "dt_bias": (heads,),
        attn + "A_log": (heads,),
        attn + "norm.weight": (linear.value_dim,),
        attn + "out_proj.weight": (h, values),
    } | _family_layer_shapes(dataclasses.replace(config, qk_norm=False), prefix)


def _family_layer_shapes(config: ModelConfig, prefix: str) -> dict[str, tuple[int, ...]]:
    """The MLP's tensors and what the newer families add to a layer."""
    h, d, inter = config.hidden_size, config.head_dim, config.intermediate_size
    shapes: dict[str, tuple[int, ...]] = {}
    if config.num_experts:
        # experts stacked (GGUF's layout; the HF loader stacks the per-expert tensors)
        experts, moe = config.num_experts, config.moe_intermediate_size
        shapes |= {
            prefix + "mlp.gate.weight": (experts, h),
            prefix + "mlp.experts.gate_proj.weight": (experts, moe, h),
            prefix + "mlp.experts.up_proj.weight": (experts, moe, h),
            prefix + "mlp.experts.down_proj.weight": (experts, h, moe),
        }
    else:
        shapes |= {
            prefix + "mlp.gate_proj.weight": (inter, h),
            prefix + "mlp.up_proj.weight": (inter, h),
            prefix + "mlp.down_proj.weight": (h, inter),
        }
    if config.swiglu_limit is not None and config.num_experts:  # gpt-oss: biases everywhere
        experts, moe = config.num_experts, config.moe_intermediate_size
        shapes |= {
            prefix + "mlp.gate.bias": (experts,),
            prefix + "mlp.experts.gate_proj.bias": (experts, moe),
            prefix + "mlp.experts.up_proj.bias": (experts, moe),
            prefix + "mlp.experts.down_proj.bias": (experts, h),
        }
    if config.attention_sinks:
        shapes[prefix + "self_attn.sinks"] = (config.num_heads,)
    if config.shared_expert_intermediate_size:
        shared = config.shared_expert_intermediate_size
        shapes |= {
            prefix + "mlp.shared_expert.gate_proj.weight": (shared, h),
            prefix + "mlp.shared_expert.up_proj.weight": (shared, h),
            prefix + "mlp.shared_expert.down_proj.weight": (h, shared),
            prefix + "mlp.shared_expert_gate.weight": (1, h),
        }
    if config.attn_output_gate and config.qk_norm:  # (linear layers pass qk_norm=False)
        shapes[prefix + "self_attn.gate_proj.weight"] = (config.q_size, h)
    if config.qk_norm:
        full = config.qk_norm_full  # OLMo 2: one weight over every head of q (of k)
        shapes |= {
            prefix + "self_attn.q_norm.weight": (config.q_size,) if full else (d,),
            prefix + "self_attn.k_norm.weight": (config.kv_size,) if full else (d,),
        }
    if config.sandwich_norms:
        shapes[prefix + "post_feedforward_layernorm.weight"] = (h,)
        if config.pre_norms:
            shapes[prefix + "pre_feedforward_layernorm.weight"] = (h,)
    return shapes


def check_weights(config: ModelConfig, weights: Mapping[str, Any], *, source: str) -> None:
    """Raise :class:`UnsupportedModelError` unless every needed tensor is there, shaped right.

    ``source`` names the file/directory in the message.
    """
    expected = expected_weight_shapes(config)
    missing = [name for name in expected if name not in weights]
    if missing:
        raise UnsupportedModelError(
            f"{source}: missing tensors {', '.join(missing[:5])}"
            f"{' ...' if len(missing) > 5 else ''}"
        )
    for name, shape in expected.items():
        if tuple(weights[name].shape) != shape:
            raise UnsupportedModelError(
                f"{source}: tensor {name} has shape {tuple(weights[name].shape)}, "
                f"the config implies {shape}"
            )
