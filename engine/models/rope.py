"""Rotary position embedding (rotate-half form, as Hugging Face Llama) with scaling variants.

Frequencies follow ``transformers``' formulas (default, linear, llama3, yarn) so logits match
the reference; llama.cpp's per-dimension ``rope_freqs`` divisors are applied on top. cos/sin are
tabulated once for every position up to the context length, then gathered per token.
"""

from __future__ import annotations

import math

import torch

from prefixgate.engine.model_config import ModelConfig, RopeScaling
from prefixgate.kernels.layer_ops import rotate_half


def _yarn(
    inv_freq: torch.Tensor, scaling: RopeScaling, dim: int, base: float
) -> tuple[torch.Tensor, float]:
    factor = scaling.factor

    def mscale(scale: float, coefficient: float = 1.0) -> float:
        return 1.0 if scale <= 1 else 0.1 * coefficient * math.log(scale) + 1.0

    attention = scaling.attention_factor
    if attention is None:
        if scaling.mscale and scaling.mscale_all_dim:
            attention = mscale(factor, scaling.mscale) / mscale(factor, scaling.mscale_all_dim)
        else:
            attention = mscale(factor)
    original = scaling.original_max_position_embeddings
    assert original is not None  # RopeScaling checks it

    def correction_dim(rotations: float) -> float:
        return (dim * math.log(original / (rotations * 2 * math.pi))) / (2 * math.log(base))

    low, high = correction_dim(scaling.beta_fast), correction_dim(scaling.beta_slow)
    if scaling.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # avoid a zero-width ramp
    ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    extrapolation = 1 - ramp  # 1 = keep the original frequency (high-frequency dims)
    # written as transformers writes it, so the fp32 rounding matches
    pos_freqs = base ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim)
    interpolated = 1.0 / (factor * pos_freqs)
    return interpolated * (1 - extrapolation) + inv_freq * extrapolation, float(attention)


def _llama3(inv_freq: torch.Tensor, scaling: RopeScaling) -> torch.Tensor:
    factor = scaling.factor
    original = scaling.original_max_position_embeddings
    assert original is not None
    low_wavelen = original / scaling.low_freq_factor
    high_wavelen = original / scaling.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    # long wavelengths are interpolated, short ones kept, the band between blended smoothly
    scaled = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
    smooth = (original / wavelen - scaling.low_freq_factor) / (
        scaling.high_freq_factor - scaling.low_freq_factor
    )
    blended = (1 - smooth) * scaled / factor + smooth * scaled
    medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
    return torch.where(medium, blended, scaled)


def _longrope(inv_freq: torch.Tensor, scaling: RopeScaling) -> tuple[torch.Tensor, float]:
    # the short factors: exact while the context stays within the original length
    assert scaling.short_factor is not None and scaling.original_max_position_embeddings
    factors = torch.tensor(scaling.short_factor, dtype=torch.float32)
    attention = scaling.attention_factor
    if attention is None:
        original = scaling.original_max_position_embeddings
        attention = (
            math.sqrt(1 + math.log(scaling.factor) / math.log(original))
            if scaling.factor > 1
            else 1.0
        )
    return inv_freq / factors, float(attention)


def inverse_frequencies(config: ModelConfig) -> tuple[torch.Tensor, float]:
    """Per-pair rotation speeds ``[rotary_dim / 2]`` (fp32) and the cos/sin scale (yarn,
    longrope)."""
    dim, base = config.rotary_dim or config.head_dim, config.rope_theta
    inv_freq = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
    attention = 1.0
    scaling = config.rope_scaling
    if scaling is not None:
        if scaling.kind == "linear":
            inv_freq = inv_freq / scaling.factor
        elif scaling.kind == "llama3":
            inv_freq = _llama3(inv_freq, scaling)
        elif scaling.kind == "yarn":
            inv_freq, attention = _yarn(inv_freq, scaling, dim, base)
        elif scaling.kind == "longrope":
            inv_freq, attention = _longrope(inv_freq, scaling)
    if config.rope_freq_factors is not None:
        inv_freq = inv_freq / torch.tensor(config.rope_freq_factors, dtype=torch.float32)
    return inv_freq, attention


class RotaryEmbedding:
    """cos/sin tables ``[max_positions, head_dim / 2]`` and the rotation of q/k heads."""

    def __init__(
        self, config: ModelConfig, max_positions: int, device: torch.device, dtype: torch.dtype
    ) -> None:
        inv_freq, attention = inverse_frequencies(config)
        positions = torch.arange(max_positions, dtype=torch.int64).float()
        angles = positions[:, None] * inv_freq[None, :]  # [P, D/2], fp32 like the reference
        self.cos = (angles.cos() * attention).to(device=device, dtype=dtype)
        self.sin = (angles.sin() * attention).to(device=device, dtype=dtype)
        self.max_positions = max_positions

    def lookup(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin for ``positions [T]``, shaped ``[T, 1, D/2]`` to broadcast over heads."""
        return self.cos[positions].unsqueeze(1), self.sin[positions].unsqueeze(1)

    # Rotate ``x [T, H, D]`` (any strides) by ``cos``/``sin [T, 1, D/2]``: the torch form; a
    # model rotates through the op the kernel registry bound at load (LayerOps.rope)
    rotate = staticmethod(rotate_half)
