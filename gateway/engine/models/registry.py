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

from prefixgate.gateway.engine.model_config import UnsupportedModelError

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
    import prefixgate.gateway.engine.models  # noqa: F401


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
        raise UnsupportedModelError(
            f"architecture {architecture!r} is not supported; supported: "
            f"{', '.join(supported_architectures())}"
        )
    return family


def require_architecture(architecture: str) -> None:
    """Raise :class:`UnsupportedModelError` unless a family runs ``architecture``."""
    family_for(architecture)
