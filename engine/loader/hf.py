"""Load a Hugging Face model directory: config.json, safetensors (one file or sharded), tokenizer.

Needs ``config.json``, ``model.safetensors`` or ``model.safetensors.index.json`` + shards, and
``tokenizer.json``; reads ``tokenizer_config.json`` (special tokens, chat template),
``chat_template.jinja`` and ``generation_config.json`` (EOS ids) when present.
"""

from __future__ import annotations

import json
import logging
import sys
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from tqdm import tqdm

from prefixgate.engine.loader.loaded_model import LoadedModel
from prefixgate.engine.model_config import (
    SUPPORTED_ARCHITECTURES,
    ModelConfig,
    RopeScaling,
    UnsupportedModelError,
    check_weights,
    expected_weight_shapes,
)
from prefixgate.engine.models.registry import (
    family_for,
    not_supported,
    supported_architectures,
)
from prefixgate.engine.tokenizer import Tokenizer

logger = logging.getLogger(__name__)

_SINGLE_FILE = "model.safetensors"
# a multimodal checkpoint's language model (Qwen3.5's own, Qwen3_5ForConditionalGeneration):
# its config under "text_config", its weights under this prefix; the vision tower and the
# multi-token-prediction head are not loaded
_LANGUAGE_MODEL_PREFIX = "model.language_model."
_INDEX_FILE = "model.safetensors.index.json"


def _read_json(path: Path) -> dict[str, Any]:
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as exc:
        raise UnsupportedModelError(f"{path}: not valid JSON ({exc})") from exc


def _rope_scaling(raw: dict[str, Any] | None) -> RopeScaling | None:
    if not raw:
        return None
    kind = raw.get("rope_type", raw.get("type"))
    if kind in (None, "default"):
        return None
    if kind == "linear" and raw.get("factor", 1.0) == 1.0:
        return None
    if kind not in ("linear", "llama3", "yarn"):
        # let RopeScaling name the supported kinds
        return RopeScaling(kind=kind, factor=float(raw.get("factor") or 1.0))
    return RopeScaling(
        kind=kind,
        factor=float(raw["factor"]),
        original_max_position_embeddings=raw.get("original_max_position_embeddings"),
        low_freq_factor=float(raw.get("low_freq_factor", 1.0)),
        high_freq_factor=float(raw.get("high_freq_factor", 4.0)),
        beta_fast=float(raw.get("beta_fast") or 32.0),
        beta_slow=float(raw.get("beta_slow") or 1.0),
        attention_factor=raw.get("attention_factor"),
        mscale=raw.get("mscale"),
        mscale_all_dim=raw.get("mscale_all_dim"),
        truncate=bool(raw.get("truncate", True)),
    )


def _longrope(scaling: dict[str, Any], raw: dict[str, Any]) -> RopeScaling:
    """Phi-3.5 / Phi-4-mini's LongRoPE (the original length may sit at the top level)."""
    original = scaling.get("original_max_position_embeddings") or raw.get(
        "original_max_position_embeddings"
    )
    if not original or "short_factor" not in scaling:
        raise UnsupportedModelError(
            "RoPE scaling 'longrope' needs short_factor and original_max_position_embeddings"
        )
    factor = scaling.get("factor") or int(raw.get("max_position_embeddings", original)) / original
    return RopeScaling(
        kind="longrope",
        factor=float(factor),
        original_max_position_embeddings=int(original),
        short_factor=tuple(float(x) for x in scaling["short_factor"]),
        attention_factor=scaling.get("attention_factor"),
    )


def _context_length(
    raw: dict[str, Any], name: str, rope_scaling: RopeScaling | None, windowed_model: bool
) -> int:
    context = int(raw.get("max_position_embeddings", 2048))
    limit, why = context, ""
    window = raw.get("sliding_window")
    if window is not None and not windowed_model and (
        raw.get("model_type") == "mistral" or raw.get("use_sliding_window")
    ):
        # NOTE: the Llama model has no sliding-window attention; capping the context keeps
        # outputs exact
        limit, why = int(window), f"sliding window {window}"
    if rope_scaling is not None and rope_scaling.kind == "longrope":
        # NOTE: past the original length LongRoPE switches to its long factors, which would
        # re-rotate keys already in shared pages; capping keeps the short factors exact
        original = rope_scaling.original_max_position_embeddings or context
        if original < limit:
            limit, why = original, f"LongRoPE original length {original}"
    if limit < context:
        logger.warning("%s: %s < context %s; capping the context length", name, why, context)
    return limit


def _rope_parameters(raw: dict[str, Any]) -> dict[str, Any]:
    # transformers 5 folds rope_theta and the scaling into "rope_parameters", per layer type
    # where layers differ (Gemma 3: the global layers' entry is the model's RoPE)
    rope = raw.get("rope_parameters") or {}
    return rope.get("full_attention", rope)


def config_from_hf(raw: dict[str, Any], name: str) -> ModelConfig:
    """Translate a HF ``config.json`` dict to a :class:`ModelConfig` (any registered family)."""
    arch = raw.get("model_type")
    if arch not in supported_architectures():
        raise UnsupportedModelError(f"{name}: model_type {arch!r} {not_supported(arch)}")
    family = family_for(arch)
    activation = raw.get("hidden_act") or raw.get("hidden_activation") or "silu"
    if activation not in family.activations:
        raise UnsupportedModelError(
            f"{name}: hidden_act {activation!r} is not supported ({', '.join(family.activations)})"
        )
    if raw.get("mlp_bias"):
        raise UnsupportedModelError(f"{name}: mlp_bias is not supported")
    extras = family.hf_config(raw)
    hidden, heads = int(raw["hidden_size"]), int(raw["num_attention_heads"])
    rope = _rope_parameters(raw)
    scaling = raw.get("rope_scaling") or (
        rope if rope.get("rope_type") not in (None, "default") else None
    )
    kind = (scaling or {}).get("rope_type", (scaling or {}).get("type"))
    rope_scaling = _longrope(scaling, raw) if kind == "longrope" else _rope_scaling(scaling)
    context = _context_length(raw, name, rope_scaling, "sliding_window" in extras)
    fields: dict[str, Any] = {
        "architecture": arch,
        "name": name,
        "vocab_size": int(raw["vocab_size"]),
        "hidden_size": hidden,
        "intermediate_size": int(raw["intermediate_size"]),
        "num_layers": int(raw["num_hidden_layers"]),
        "num_heads": heads,
        "num_kv_heads": int(raw.get("num_key_value_heads") or heads),
        "head_dim": int(raw.get("head_dim") or hidden // heads),
        "rms_norm_eps": float(raw.get("rms_norm_eps", 1e-6)),
        "rope_theta": float(raw.get("rope_theta", rope.get("rope_theta", 10000.0))),
        "max_position_embeddings": context,
        "tie_word_embeddings": bool(raw.get("tie_word_embeddings", False)),
        "attention_bias": SUPPORTED_ARCHITECTURES.get(arch, False)
        or bool(raw.get("attention_bias", False)),
        # llama's attention_bias covers o_proj too; qwen2's built-in q/k/v bias does not
        "attention_out_bias": arch != "qwen2" and bool(raw.get("attention_bias", False)),
        "rope_scaling": rope_scaling,
    }
    return ModelConfig(**(fields | extras))


def _language_model_config(raw: dict[str, Any]) -> tuple[dict[str, Any], bool]:
    """A multimodal checkpoint's text config (True), or ``raw`` itself (False): the outer
    ``model_type`` (``qwen3_5``) is not one we run, its ``text_config``'s (``qwen3_5_text``) is."""
    text = raw.get("text_config")
    supported = supported_architectures()
    if (isinstance(text, dict) and raw.get("model_type") not in supported
            and text.get("model_type") in supported):
        tied = text.get("tie_word_embeddings", raw.get("tie_word_embeddings", False))
        return {**text, "tie_word_embeddings": tied,
                "_name_or_path": raw.get("_name_or_path") or text.get("_name_or_path")}, True
    return raw, False


def _text_weight_name(key: str) -> str | None:
    """A multimodal checkpoint's tensor name as the language model's (None: not loaded)."""
    if key.startswith(_LANGUAGE_MODEL_PREFIX):
        return "model." + key.removeprefix(_LANGUAGE_MODEL_PREFIX)
    return key if key == "lm_head.weight" else None


def _weight_files(directory: Path) -> list[Path]:
    if (directory / _INDEX_FILE).is_file():
        weight_map = _read_json(directory / _INDEX_FILE).get("weight_map", {})
        files = sorted({directory / f for f in weight_map.values()})
    elif (directory / _SINGLE_FILE).is_file():
        files = [directory / _SINGLE_FILE]
    else:
        files = sorted(directory.glob("*.safetensors"))
    if not files:
        raise UnsupportedModelError(
            f"{directory}: no safetensors weights ({_SINGLE_FILE} or {_INDEX_FILE}); "
            "PyTorch .bin checkpoints are not supported"
        )
    missing = [f.name for f in files if not f.is_file()]
    if missing:
        raise UnsupportedModelError(f"{directory}: missing weight shards {', '.join(missing)}")
    return files


def _load_tokenizer(directory: Path) -> Tokenizer:
    tokenizer_json = directory / "tokenizer.json"
    if not tokenizer_json.is_file():
        raise UnsupportedModelError(
            f"{directory}: no tokenizer.json (a sentencepiece tokenizer.model alone is not "
            "supported; save the tokenizer with a fast tokenizer to get tokenizer.json)"
        )
    config_path = directory / "tokenizer_config.json"
    tokenizer_config = _read_json(config_path) if config_path.is_file() else {}
    template_path = directory / "chat_template.jinja"
    template = template_path.read_text(encoding="utf-8") if template_path.is_file() else None
    if template is None and (directory / "chat_template.json").is_file():
        template = _read_json(directory / "chat_template.json").get("chat_template")
    eos_ids: list[int] = []
    generation_path = directory / "generation_config.json"
    if generation_path.is_file():
        eos = _read_json(generation_path).get("eos_token_id")
        eos_ids = [eos] if isinstance(eos, int) else list(eos or [])
    return Tokenizer.from_hf_files(
        str(tokenizer_json),
        tokenizer_config=tokenizer_config,
        generation_eos_ids=eos_ids,
        chat_template=template,
    )


def load_hf(directory: str | Path, *, progress: bool | None = None) -> LoadedModel:
    """Read a HF model directory (safetensors weights).

    Args:
        directory: folder with ``config.json``, safetensors weights and ``tokenizer.json``.
        progress: show a tqdm bar on stderr (None = only when stderr is a terminal).

    Raises:
        FileNotFoundError: no such directory or no config.json.
        UnsupportedModelError: unsupported model type, missing or mis-shaped tensors...
    """
    directory = Path(directory)
    if not (directory / "config.json").is_file():
        raise FileNotFoundError(f"not a Hugging Face model directory (no config.json): {directory}")
    raw = _read_json(directory / "config.json")
    raw, multimodal = _language_model_config(raw)
    config = config_from_hf(raw, raw.get("_name_or_path") or directory.name)
    tokenizer = _load_tokenizer(directory)
    needed = expected_weight_shapes(config)
    weights: dict[str, torch.Tensor] = {}
    files = _weight_files(directory)
    disable = (not sys.stderr.isatty()) if progress is None else not progress
    for file in tqdm(
        files, desc=f"loading {directory.name}", unit="shard", file=sys.stderr, disable=disable
    ):
        with safe_open(str(file), framework="pt") as handle:
            for key in handle.keys():  # noqa: SIM118 - safe_open is not a dict
                name = _text_weight_name(key) if multimodal else key
                if name is not None and not name.endswith("rotary_emb.inv_freq"):
                    weights[name] = handle.get_tensor(key)
    # the family renames/splits/stacks its own tensors (Phi's fused qkv, MoE experts)
    weights = family_for(config.architecture).adapt_weights(weights, config, "hf")
    for key in [k for k in weights if k not in needed]:
        if key != "lm_head.weight":
            logger.warning("%s: ignoring unknown tensor %s", directory.name, key)
        del weights[key]
    check_weights(config, weights, source=str(directory))
    return LoadedModel(config=config, weights=weights, tokenizer=tokenizer, path=directory)
