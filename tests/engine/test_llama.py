"""Building blocks of the Llama model vs their transformers counterparts."""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.nn.functional as F
import transformers
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
from transformers.models.llama.modeling_llama import LlamaRMSNorm, apply_rotary_pos_emb

from prefixgate.engine.model_config import ModelConfig, RopeScaling, UnsupportedModelError
from prefixgate.engine.models.layers import rms_norm
from prefixgate.engine.models.linear import Linear, onednn_linear_available
from prefixgate.engine.models.rope import RotaryEmbedding, inverse_frequencies
from prefixgate.kernels.cpu.library import native_status

BASE = ModelConfig(
    architecture="llama",
    name="unit",
    vocab_size=64,
    hidden_size=256,
    intermediate_size=512,
    num_layers=1,
    num_heads=4,
    num_kv_heads=2,
    head_dim=64,
    rms_norm_eps=1e-5,
    rope_theta=500000.0,
    max_position_embeddings=8192,
    tie_word_embeddings=True,
    attention_bias=False,
)

SCALINGS = {
    "linear": (RopeScaling("linear", 4.0), {"rope_type": "linear", "factor": 4.0}),
    "llama3": (
        RopeScaling(
            "llama3",
            8.0,
            original_max_position_embeddings=8192,
            low_freq_factor=1.0,
            high_freq_factor=4.0,
        ),
        {
            "rope_type": "llama3",
            "factor": 8.0,
            "original_max_position_embeddings": 8192,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
        },
    ),
    "yarn": (
        RopeScaling("yarn", 4.0, original_max_position_embeddings=2048),
        {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 2048},
    ),
    "yarn-mscale": (
        RopeScaling(
            "yarn",
            40.0,
            original_max_position_embeddings=4096,
            beta_fast=32,
            beta_slow=1,
            mscale=1.0,
            mscale_all_dim=0.707,
        ),
        {
            "rope_type": "yarn",
            "factor": 40.0,
            "original_max_position_embeddings": 4096,
            "beta_fast": 32,
            "beta_slow": 1,
            "mscale": 1.0,
            "mscale_all_dim": 0.707,
        },
    ),
}


def _hf_config(parameters: dict | None) -> transformers.LlamaConfig:
    rope = {"rope_type": "default", "rope_theta": BASE.rope_theta, **(parameters or {})}
    return transformers.LlamaConfig(
        hidden_size=BASE.hidden_size,
        num_attention_heads=BASE.num_heads,
        max_position_embeddings=BASE.max_position_embeddings * 4,
        rope_parameters=rope,
    )


@pytest.mark.parametrize("name", ["none", *SCALINGS])
def test_inverse_frequencies_match_transformers(name):
    ours_scaling, hf_params = SCALINGS.get(name, (None, None))
    config = dataclasses.replace(BASE, rope_scaling=ours_scaling)
    inv_freq, attention = inverse_frequencies(config)
    hf_config = _hf_config(hf_params)
    kind = hf_config.rope_parameters["rope_type"]
    if kind == "default":
        ref = 1.0 / (BASE.rope_theta ** (torch.arange(0, 64, 2, dtype=torch.int64).float() / 64))
        ref_attention = 1.0
    else:
        ref, ref_attention = ROPE_INIT_FUNCTIONS[kind](hf_config, "cpu")
    assert torch.equal(inv_freq, ref.float())
    assert attention == pytest.approx(ref_attention)


def test_rotation_matches_transformers():
    config = dataclasses.replace(BASE, rope_scaling=SCALINGS["yarn"][0])
    rope = RotaryEmbedding(config, 4096, torch.device("cpu"), torch.float32)
    positions = torch.tensor([0, 1, 7, 300, 4095])
    q = torch.randn(5, 4, 64)
    k = torch.randn(5, 2, 64)
    cos, sin = rope.lookup(positions)
    inv_freq, attention = inverse_frequencies(config)
    angles = positions[:, None].float() * inv_freq[None]
    hf_cos = torch.cat([angles.cos(), angles.cos()], -1) * attention  # [T, D]
    hf_sin = torch.cat([angles.sin(), angles.sin()], -1) * attention
    ref_q, ref_k = apply_rotary_pos_emb(
        q.transpose(0, 1)[None], k.transpose(0, 1)[None], hf_cos[None], hf_sin[None]
    )
    assert torch.allclose(rope.rotate(q, cos, sin), ref_q[0].transpose(0, 1), atol=1e-6)
    assert torch.allclose(rope.rotate(k, cos, sin), ref_k[0].transpose(0, 1), atol=1e-6)


def test_dynamic_rope_scaling_is_rejected():
    with pytest.raises(UnsupportedModelError, match="'dynamic' is not supported"):
        RopeScaling("dynamic", 2.0)
    with pytest.raises(UnsupportedModelError, match="original_max_position_embeddings"):
        RopeScaling("llama3", 8.0)


def test_rms_norm_matches_transformers():
    norm = LlamaRMSNorm(256, eps=1e-5)
    with torch.no_grad():
        norm.weight.uniform_(0.5, 1.5)
    x = torch.randn(7, 256) * 3
    assert torch.allclose(rms_norm(x, norm.weight.detach(), 1e-5), norm(x).detach(), atol=1e-6)


@pytest.mark.parametrize(("pack", "native"), [(True, False), (False, False), (False, True)])
# rows: a decode row, a partial 16-row tile, full tiles + a tail; 100 columns: a partial block
@pytest.mark.parametrize("rows", [1, 5, 16, 64, 37])
def test_linear_layouts_agree_with_f_linear(pack, native, rows):
    weight = torch.randn(100, 256)
    bias = torch.randn(100)
    x = torch.randn(rows, 256)
    residual = torch.randn(rows, 130)[:, 10:110]  # rows at a stride of their own
    layer = Linear(weight, bias, pack=pack, native=native)
    if native and layer.native is None:
        pytest.skip(f"native linear not used here: {native_status()}")
    assert (layer.packed is not None) == (pack and not native and onednn_linear_available())
    ref = F.linear(x, weight, bias)
    assert torch.allclose(layer(x), ref, atol=1e-4)
    assert torch.allclose(layer.add_to(x, residual), ref + residual, atol=1e-4)
    no_bias = Linear(weight, pack=pack, native=native)
    assert torch.allclose(no_bias.add_to(x, residual), F.linear(x, weight) + residual, atol=1e-4)
    # strided rows (a slice of a wider activation) and an empty batch
    wide = torch.randn(rows, 300)
    assert torch.allclose(layer(wide[:, 20:276]), F.linear(wide[:, 20:276], weight, bias), atol=1e-4)
    assert layer(torch.randn(0, 256)).shape == (0, 100)
    # a column stride other than 1 goes through one dense copy
    transposed = torch.randn(256, rows).t()
    assert torch.allclose(layer(transposed), F.linear(transposed, weight, bias), atol=1e-4)


@pytest.mark.parametrize(("pack", "native"), [(True, False), (False, False), (False, True)])
@pytest.mark.parametrize("rows", [1, 37])
def test_bf16_linear_takes_and_returns_fp32(pack, native, rows):
    """The CPU bf16 mode's layer on each of its paths (native, oneDNN, F.linear): fp32 in and
    out, the product of the bf16-rounded inputs, bias and residual added in fp32."""
    weight = torch.randn(100, 256)
    bias, x = torch.randn(100), torch.randn(rows, 256)
    residual = torch.randn(rows, 100)
    layer = Linear(weight.bfloat16(), bias, pack=pack, native=native)
    if native and layer.native is None:
        pytest.skip(f"native bf16 linear not used here: {native_status()}")
    assert layer.bf16
    ref = F.linear(x.bfloat16().float(), weight.bfloat16().float(), bias)
    # the torch paths round their output to bf16 once (|y| <~ 50: within 0.25)
    tolerance = 1e-4 if layer.native is not None else 0.25
    out = layer(x)
    assert out.dtype == torch.float32 and torch.allclose(out, ref, atol=tolerance)
    assert torch.allclose(layer.add_to(x, residual), ref + residual, atol=tolerance)


def test_model_config_rejects_bad_shapes():
    with pytest.raises(UnsupportedModelError, match="'gpt2' is not supported"):
        dataclasses.replace(BASE, architecture="gpt2")
    with pytest.raises(UnsupportedModelError, match="multiple of num_kv_heads"):
        dataclasses.replace(BASE, num_kv_heads=3)
    with pytest.raises(UnsupportedModelError, match="hidden_size must be positive"):
        dataclasses.replace(BASE, hidden_size=0)


def test_shared_linear_builds_once_per_sources_and_flags_and_forgets_freed_sources():
    import gc

    from prefixgate.engine.models import linear as linear_module

    sources = [torch.randn(8, 16), torch.randn(8, 16)]  # the layers never hold their sources
    built: list[Linear] = []

    def build() -> Linear:
        built.append(Linear(torch.randn(8, 16), pack=False))
        return built[-1]

    def shared(parts, dtype=torch.float32) -> Linear:
        return linear_module.shared_linear(parts, (torch.device("cpu"), dtype), build)

    first = shared(sources[:1])
    assert shared(sources[:1]) is first and len(built) == 1
    assert shared(sources[:1], torch.bfloat16) is not first
    assert shared(sources) is not first and len(built) == 3
    keys = [key for key in linear_module._SHARED if id(sources[0]) in key]
    assert len(keys) == 3
    del sources[0], first, built[:]
    gc.collect()
    assert not any(key in linear_module._SHARED for key in keys)


def test_models_over_one_loaded_model_share_their_quantized_layers(loaded_model):
    """The quantized blocks are packed once per loaded model: a second runner reuses them."""
    from prefixgate.engine.runner import ModelRunner

    runners = [ModelRunner.from_loaded(loaded_model, num_pages=4) for _ in range(2)]
    first, second = (r.model for r in runners)
    if first.layers[0].qkv.quant is None:
        pytest.skip(f"quantized native kernel not available here: {native_status()}")
    assert first.layers[0].qkv is second.layers[0].qkv and first.lm_head is second.lm_head
    assert first.layers[-1].mlp.down is second.layers[-1].mlp.down
