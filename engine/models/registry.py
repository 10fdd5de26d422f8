"""The model families: each family's module registers itself here; nothing else lists them.

A family knows its architecture names (HF ``model_type`` and GGUF ``general.architecture``
spell some differently: ``qwen3_moe`` / ``qwen3moe``), the model class that runs it, and what
its files carry beyond the Llama layout: extra config fields, extra or renamed GGUF tensors, and
a hook that rewrites loaded weights into the names and layout ``expected_weight_shapes`` wants
(Phi's fused tensors split, Gemma's GGUF norms shifted, MoE experts stacked).

The loaders read the common fields (sizes, heads, RoPE) themselves and ask the family for the
rest, so adding a family is one new module plus one import in ``models/__init__.py``.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from prefixgate.engine.model_config import UnsupportedModelError

# (weights by name, config, "hf" | "gguf") -> weights in the canonical names and layout
WeightAdapter = Callable[[dict[str, Any], Any, str], dict[str, Any]]


def _no_extras(_source: Any) -> dict[str, Any]:
    return {}


def _same_weights(weights: dict[str, Any], _config: Any, _fmt: str) -> dict[str, Any]:
    return weights


@dataclass(frozen=True, slots=True)
class ModelFamily:
    """One family of architectures run by one model class.

    Args:
        name: the family's name in messages and docs.
        model_class: built as ``model_class(config, weights, device=..., dtype=..., ...)``.
        hf_model_types: ``config.json`` ``model_type`` values.
        gguf_architectures: GGUF ``general.architecture`` values.
        hf_config: ``config.json`` dict -> extra :class:`ModelConfig` fields.
        gguf_config: ``meta(suffix, default)`` (reads ``<arch>.<suffix>``) -> extra fields.
        gguf_tensors: per-layer GGUF tensor name -> HF name, over the Llama table.
        gguf_permuted_qk: llama.cpp permuted this family's Q/K rows (llama-arch files).
        adapt_weights: rewrites loaded weights into the canonical names and layout.
        activations: HF ``hidden_act`` / ``hidden_activation`` values it accepts.
    """

    name: str
    model_class: type
    hf_model_types: tuple[str, ...]
    gguf_architectures: tuple[str, ...]
    hf_config: Callable[[dict[str, Any]], dict[str, Any]] = _no_extras
    gguf_config: Callable[[Callable[..., Any]], dict[str, Any]] = _no_extras
    gguf_tensors: Mapping[str, str] = field(default_factory=dict)
    gguf_permuted_qk: bool = False
    adapt_weights: WeightAdapter = _same_weights
    activations: tuple[str, ...] = ("silu",)


_FAMILIES: dict[str, ModelFamily] = {}
_BY_ARCHITECTURE: dict[str, ModelFamily] = {}

# Architectures no family runs whose nearest registered family differs by a named part (what
# the "not supported" message tells a user); only those that are close: a name that merely
# looks alike (llama4: MoE with chunked attention) is not listed.
_CLOSEST: dict[str, tuple[str, str]] = {
    "granitemoe": ("granite", "Granite 3.x's multipliers with a mixture-of-experts MLP"),
    "granitemoeshared": ("granite", "Granite 3.x with routed and shared experts"),
    "gemma2": ("gemma3", "no q/k norms, attention logit softcapping"),
    "gemma": ("gemma3", "no sandwich or q/k norms, no sliding layers"),
    "mixtral": ("qwen3_moe", "a top-2 MoE with Llama attention, no q/k norms"),
    "qwen2_moe": ("qwen3_moe", "plus a shared expert and q/k/v biases, no q/k norms"),
}


def register_family(family: ModelFamily) -> ModelFamily:
    """Add ``family``; an architecture name claimed twice is a programming error."""
    names = (*family.hf_model_types, *family.gguf_architectures)
    taken = [n for n in names if n in _BY_ARCHITECTURE and _BY_ARCHITECTURE[n] is not family]
    if taken:
        raise ValueError(f"architectures {taken} are registered twice")
    _FAMILIES[family.name] = family
    for name in names:
        _BY_ARCHITECTURE[name] = family
    return family


def _ensure_registered() -> None:
    # importing the package imports every family module, which registers itself
    import prefixgate.engine.models  # noqa: F401


def families() -> dict[str, ModelFamily]:
    """Every registered family by name."""
    _ensure_registered()
    return dict(_FAMILIES)


def supported_architectures() -> list[str]:
    """Every architecture name a loader accepts, in registration order (Llama's first)."""
    _ensure_registered()
    return list(_BY_ARCHITECTURE)


def family_for(architecture: str | None) -> ModelFamily:
    """The family running ``architecture``.

    Raises:
        UnsupportedModelError: no family runs it; the message names those that do.
    """
    _ensure_registered()
    family = _BY_ARCHITECTURE.get(architecture or "")
    if family is None:
        raise UnsupportedModelError(f"architecture {architecture!r} {not_supported(architecture)}")
    return family


def not_supported(architecture: str | None) -> str:
    """``is not supported; supported: …`` and, when one is close, the nearest family and how
    ``architecture`` differs from it (or the registered spelling of a mistyped name)."""
    _ensure_registered()
    message = f"is not supported; supported: {', '.join(supported_architectures())}"
    name = (architecture or "").lower().replace("-", "_")
    if name in _BY_ARCHITECTURE:  # a spelling away: Qwen3, qwen3-moe
        return f"{message}; did you mean {name!r}?"
    closest = _CLOSEST.get(name)
    if closest is not None and closest[0] in _FAMILIES:
        return f"{message}; the closest supported family is {closest[0]!r} ({closest[1]})"
    return message


def require_architecture(architecture: str) -> None:
    """Raise :class:`UnsupportedModelError` unless a family runs ``architecture``."""
    family_for(architecture)
