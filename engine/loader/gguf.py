"""Load a GGUF file (llama.cpp's format): config, weights, tokenizer.

Matrices in Q4_0, Q4_1 or Q8_0 stay in their ggml blocks (``QuantizedTensor``, kernels/quant.py:
the native CPU kernel computes on them, and they are 5-6x smaller than fp32; the model
dequantizes them exactly where it computes otherwise), and so do gpt-oss's MXFP4 experts
(``Mxfp4Tensor``, kernels/torch_cpu/mxfp4.py); every other tensor is dequantised to
fp32 with ``gguf.quants``. All are renamed to Hugging Face parameter names. llama.cpp's converter permutes the rows of Q and K of llama-arch models (it interleaves
the two rotary halves of every head); we undo that so the model code uses HF's rotate-half RoPE.
The metadata (the tokenizer's 150k-entry arrays included) is parsed by
:class:`~engine.loader.gguf_reader.FastGGUFReader`: gguf-py's reader takes seconds there.
"""

from __future__ import annotations

import logging
import re
import sys
from pathlib import Path
from typing import Any

import numpy as np
import torch
from gguf import GGMLQuantizationType, GGUFReader, ReaderTensor
from gguf.quants import dequantize
from tqdm import tqdm

from prefixgate.engine.gguf_vocab import GGUFVocab
from prefixgate.engine.loader.gguf_reader import FastGGUFReader, field_value
from prefixgate.engine.loader.loaded_model import LoadedModel
from prefixgate.engine.model_config import (
    SUPPORTED_ARCHITECTURES,
    ModelConfig,
    RopeScaling,
    UnsupportedModelError,
    check_weights,
)
from prefixgate.engine.models.registry import (
    family_for,
    not_supported,
    supported_architectures,
)
from prefixgate.engine.tokenizer import Tokenizer
from prefixgate.kernels.quant import QuantizedTensor
from prefixgate.kernels.torch_cpu.mxfp4 import Mxfp4Tensor

logger = logging.getLogger(__name__)

_Q = GGMLQuantizationType
SUPPORTED_TENSOR_TYPES: tuple[GGMLQuantizationType, ...] = (
    _Q.F32, _Q.F16, _Q.BF16,
    _Q.Q4_0, _Q.Q4_1, _Q.Q5_0, _Q.Q5_1, _Q.Q8_0,
    _Q.Q2_K, _Q.Q3_K, _Q.Q4_K, _Q.Q5_K, _Q.Q6_K, _Q.MXFP4,
)  # fmt: skip

# kept in their blocks (see the module docstring); the K-quants are not (yet): their 256-weight
# super-blocks with 6-bit sub-scales need their own kernel
KEPT_QUANTIZED: dict[GGMLQuantizationType, str] = {_Q.Q4_0: "Q4_0", _Q.Q4_1: "Q4_1", _Q.Q8_0: "Q8_0"}
# families whose MoE runs MXFP4 experts in their blocks (models/gpt_oss_moe.py); elsewhere
# MXFP4 tensors are dequantised like the K-quants
MXFP4_FAMILIES = frozenset({"gpt_oss"})

_GLOBAL_TENSORS = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_LAYER_TENSORS = {
    "attn_norm.weight": "input_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_q.bias": "self_attn.q_proj.bias",
    "attn_k.bias": "self_attn.k_proj.bias",
    "attn_v.bias": "self_attn.v_proj.bias",
    "attn_output.weight": "self_attn.o_proj.weight",
    "attn_output.bias": "self_attn.o_proj.bias",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
}
_LAYER_NAME = re.compile(r"^blk\.(\d+)\.(.+)$")
_ROPE_FREQS = "rope_freqs.weight"
_ROPE_SHORT = "rope_factors_short.weight"
# RoPE tables llama.cpp stores as tensors; they become config fields, not weights
_ROPE_TENSORS = frozenset({_ROPE_FREQS, _ROPE_SHORT, "rope_factors_long.weight"})


def _field_value(reader: GGUFReader, key: str) -> Any:
    """Metadata value as a Python object (str, int, float, bool, or list), None when absent.
    ``reader`` is a :class:`FastGGUFReader` (the loaders) or gguf-py's own (the reference)."""
    if isinstance(reader, FastGGUFReader):
        return reader.value(key)
    field = reader.fields.get(key)
    return None if field is None else field_value(field)


def _read_config(
    reader: GGUFReader, path: Path, tensor_shapes: dict[str, list[int]]
) -> ModelConfig:
    arch = _field_value(reader, "general.architecture")
    if arch not in supported_architectures():
        raise UnsupportedModelError(f"{path.name}: GGUF architecture {arch!r} {not_supported(arch)}")

    def meta(suffix: str, default: Any = None) -> Any:
        value = _field_value(reader, f"{arch}.{suffix}")
        return default if value is None else value

    hidden = meta("embedding_length")
    num_heads = meta("attention.head_count")
    if hidden is None or num_heads is None or meta("block_count") is None:
        raise UnsupportedModelError(f"{path.name}: GGUF metadata lacks the {arch} model shape")
    if isinstance(num_heads, list) or isinstance(meta("attention.head_count_kv"), list):
        raise UnsupportedModelError(f"{path.name}: per-layer head counts are not supported")
    embed_shape = tensor_shapes.get("token_embd.weight")
    vocab = meta("vocab_size") or (embed_shape[1] if embed_shape else None)
    if vocab is None:
        vocab = len(_field_value(reader, "tokenizer.ggml.tokens") or ())
    fields: dict[str, Any] = {
        "architecture": arch,
        "name": _field_value(reader, "general.name") or path.stem,
        "vocab_size": int(vocab),
        "hidden_size": int(hidden),
        "intermediate_size": int(meta("feed_forward_length", 0)),
        "num_layers": int(meta("block_count")),
        "num_heads": int(num_heads),
        "num_kv_heads": int(meta("attention.head_count_kv", num_heads)),
        "head_dim": int(meta("attention.key_length", hidden // num_heads)),
        "rms_norm_eps": float(meta("attention.layer_norm_rms_epsilon", 1e-5)),
        "rope_theta": float(meta("rope.freq_base", 10000.0)),
        "max_position_embeddings": int(meta("context_length", 2048)),
        "tie_word_embeddings": "output.weight" not in tensor_shapes,
        "attention_bias": SUPPORTED_ARCHITECTURES.get(arch, False)
        or "blk.0.attn_q.bias" in tensor_shapes,
        "attention_out_bias": "blk.0.attn_output.bias" in tensor_shapes,
    }
    fields |= _read_rope(reader, path, tensor_shapes, meta)
    return ModelConfig(**(fields | family_for(arch).gguf_config(meta)))


def _small_tensor(reader: GGUFReader, name: str) -> tuple[float, ...]:
    tensor = next(t for t in reader.tensors if t.name == name)
    return tuple(float(x) for x in dequantize(tensor.data, tensor.tensor_type).reshape(-1))


def _read_rope(
    reader: GGUFReader, path: Path, tensor_shapes: dict[str, list[int]], meta: Any
) -> dict[str, Any]:
    """The RoPE fields: scaling from metadata, llama.cpp's per-pair tables from tensors."""
    fields: dict[str, Any] = {"rope_scaling": _read_rope_scaling(meta), "rope_freq_factors": None}
    if _ROPE_FREQS in tensor_shapes:
        fields["rope_freq_factors"] = _small_tensor(reader, _ROPE_FREQS)
    if _ROPE_SHORT in tensor_shapes:  # LongRoPE (Phi-3.5, Phi-4-mini)
        context = int(meta("context_length", 2048))
        original = int(meta("rope.scaling.original_context_length") or context)
        attention = meta("rope.scaling.attn_factor")
        fields["rope_scaling"] = RopeScaling(
            kind="longrope",
            factor=context / original,
            original_max_position_embeddings=original,
            short_factor=_small_tensor(reader, _ROPE_SHORT),
            attention_factor=float(attention) if attention is not None else None,
        )
        if original < context:
            # NOTE: the long factors would re-rotate cached keys; the short ones are exact
            logger.warning("%s: LongRoPE: capping the context %s at %s", path.name, context, original)
            fields["max_position_embeddings"] = original
    return fields


def _read_rope_scaling(meta: Any) -> RopeScaling | None:
    kind = meta("rope.scaling.type")
    factor = meta("rope.scaling.factor")
    if kind is None and meta("rope.scale_linear") is not None:  # pre-2024 files
        kind, factor = "linear", meta("rope.scale_linear")
    if kind in (None, "none"):
        return None
    if factor is None:
        raise UnsupportedModelError(f"RoPE scaling {kind!r} without rope.scaling.factor")
    if kind == "linear" and factor == 1.0:
        return None
    original = meta("rope.scaling.original_context_length")
    return RopeScaling(
        kind=kind,
        factor=float(factor),
        original_max_position_embeddings=int(original) if original else None,
        beta_fast=float(meta("rope.scaling.yarn_beta_fast", 32.0)),
        beta_slow=float(meta("rope.scaling.yarn_beta_slow", 1.0)),
    )


def _read_vocab(reader: GGUFReader, path: Path) -> GGUFVocab:
    def meta(key: str) -> Any:
        return _field_value(reader, f"tokenizer.{key}")

    model = meta("ggml.model")
    tokens = meta("ggml.tokens")
    if model is None or not tokens:
        raise UnsupportedModelError(f"{path.name}: the GGUF file carries no tokenizer")
    add_space = meta("ggml.add_space_prefix")
    return GGUFVocab(
        model=model,
        tokens=tokens,
        pre=meta("ggml.pre"),
        token_types=meta("ggml.token_type"),
        merges=meta("ggml.merges"),
        scores=meta("ggml.scores"),
        bos_token_id=meta("ggml.bos_token_id"),
        eos_token_id=meta("ggml.eos_token_id"),
        unk_token_id=meta("ggml.unknown_token_id"),
        pad_token_id=meta("ggml.padding_token_id"),
        eot_token_id=meta("ggml.eot_token_id"),
        eom_token_id=meta("ggml.eom_token_id"),
        # llama.cpp's default: sentencepiece vocabularies add BOS unless told otherwise
        add_bos=bool(
            meta("ggml.add_bos_token")
            if meta("ggml.add_bos_token") is not None
            else model == "llama"
        ),
        add_eos=bool(meta("ggml.add_eos_token") or False),
        add_space_prefix=True if add_space is None else bool(add_space),
        chat_template=meta("chat_template"),
    )


def _hf_name(gguf_name: str, layer_tensors: dict[str, str] = _LAYER_TENSORS) -> str | None:
    if gguf_name in _GLOBAL_TENSORS:
        return _GLOBAL_TENSORS[gguf_name]
    match = _LAYER_NAME.match(gguf_name)
    if match and match.group(2) in layer_tensors:
        return f"model.layers.{match.group(1)}.{layer_tensors[match.group(2)]}"
    return None


def _unpermute_rows(weight: np.ndarray, num_heads: int) -> np.ndarray:
    """Undo llama.cpp's ``permute``: per head, rows were reordered [pairs, 2] -> [2, pairs]."""
    rows = weight.shape[0]
    half = rows // num_heads // 2
    return (
        weight.reshape(num_heads, half, 2, *weight.shape[1:]).swapaxes(1, 2).reshape(weight.shape)
    )


def require_gguf_file(path: Path) -> None:
    """Raise UnsupportedModelError unless ``path`` starts with the GGUF magic."""
    with path.open("rb") as handle:
        magic = handle.read(4)
    if magic != b"GGUF":
        raise UnsupportedModelError(
            f"{path}: not a GGUF file (magic {magic!r}); pass a .gguf file or a Hugging Face "
            "model directory"
        )


def _check_tensors(
    reader: GGUFReader, path: Path, architecture: str, layer_tensors: dict[str, str]
) -> None:
    """Raise UnsupportedModelError for a tensor type or a tensor name we do not read."""
    unsupported = [
        f"{t.name} ({t.tensor_type.name})"
        for t in reader.tensors
        if t.tensor_type not in SUPPORTED_TENSOR_TYPES
    ]
    if unsupported:
        raise UnsupportedModelError(
            f"{path.name}: tensor type not supported: {', '.join(unsupported[:5])}"
            f"{' ...' if len(unsupported) > 5 else ''}; supported: "
            f"{', '.join(t.name for t in SUPPORTED_TENSOR_TYPES)}"
        )
    unknown = [
        t.name
        for t in reader.tensors
        if t.name not in _ROPE_TENSORS and _hf_name(t.name, layer_tensors) is None
    ]
    if unknown:
        raise UnsupportedModelError(
            f"{path.name}: tensors this {architecture} loader does not know: "
            f"{', '.join(unknown[:5])}{' ...' if len(unknown) > 5 else ''}"
        )


def _read_tensor(
    tensor: ReaderTensor, shape: tuple[int, ...], keep_quantized: bool,
    unpermute_heads: int | None, keep_mxfp4: bool = False,
) -> torch.Tensor | QuantizedTensor | Mxfp4Tensor:
    """One GGUF tensor as fp32, or (``keep_quantized``, a kept type) as its ggml blocks.

    ``unpermute_heads``: undo llama.cpp's Q/K row permutation for this many heads.
    ``keep_mxfp4``: stacked MXFP4 experts stay in blocks (families whose MoE runs them).
    """
    qtype = KEPT_QUANTIZED.get(tensor.tensor_type) if keep_quantized else None
    rows = int(np.prod(shape[:-1]))  # MoE experts [E, I, H]: E * I rows of blocks
    if keep_mxfp4 and tensor.tensor_type == _Q.MXFP4 and len(shape) == 3:
        # gpt-oss's experts: kept in blocks for the MXFP4 kernel (kernels/torch_cpu/mxfp4.py)
        data = torch.from_numpy(np.array(tensor.data, dtype=np.uint8, copy=True))
        return Mxfp4Tensor.from_gguf(data, (rows, shape[-1]))
    if qtype is not None and len(shape) in (2, 3):
        array = np.asarray(tensor.data).reshape(rows, -1)  # a row's blocks, as bytes
    else:
        qtype = None
        array = dequantize(tensor.data, tensor.tensor_type).reshape(shape)
    if unpermute_heads is not None:
        array = _unpermute_rows(array, unpermute_heads)
    # NOTE: F32 tensors and raw blocks are read-only views of the memory-mapped file;
    # copy them out
    if qtype is not None:
        data = torch.from_numpy(np.array(array, dtype=np.uint8, copy=True))
        # a stacked [E, I, H] stays one [E * I, H] block matrix; its family regroups it
        return QuantizedTensor(qtype, data, (rows, shape[-1]))
    return torch.from_numpy(np.array(array, dtype=np.float32, copy=True))


def load_gguf(
    path: str | Path, *, progress: bool | None = None, keep_quantized: bool = True
) -> LoadedModel:
    """Read a GGUF model file.

    Args:
        path: the ``.gguf`` file.
        progress: show a tqdm bar on stderr (None = only when stderr is a terminal).
        keep_quantized: keep Q4_0/Q4_1/Q8_0 matrices as ``QuantizedTensor``; False: every
            weight dequantised to fp32 (the same values).

    Returns:
        The config, weights by HF name (fp32 tensors, and ``QuantizedTensor`` matrices unless
        ``keep_quantized`` is off), and the tokenizer built from the file's metadata.

    Raises:
        FileNotFoundError: no such file.
        UnsupportedModelError: unsupported architecture, tensor type or unknown tensor.
    """
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"GGUF file not found: {path}")
    reader = FastGGUFReader(path)
    # ggml lists dims fastest-first; numpy/torch order is the reverse
    shapes = {t.name: [int(d) for d in t.shape] for t in reader.tensors}
    config = _read_config(reader, path, shapes)
    family = family_for(config.architecture)
    # the family's own tensors (q/k norms, experts, fused Phi tensors) over the Llama table
    layer_tensors = {**_LAYER_TENSORS, **family.gguf_tensors}
    _check_tensors(reader, path, config.architecture, layer_tensors)
    tokenizer = Tokenizer.from_gguf_vocab(_read_vocab(reader, path))

    weights: dict[str, torch.Tensor] = {}
    bar = tqdm(
        reader.tensors,
        desc=f"loading {path.name}",
        unit="tensor",
        file=sys.stderr,
        disable=(not sys.stderr.isatty()) if progress is None else not progress,
    )
    for tensor in bar:
        name = _hf_name(tensor.name, layer_tensors)
        if name is None:  # a RoPE table: already folded into the config
            continue
        shape = tuple(reversed(shapes[tensor.name]))
        unpermute_heads = None
        if family.gguf_permuted_qk and tensor.name.endswith(("attn_q.weight", "attn_q.bias")):
            unpermute_heads = config.num_heads
        elif family.gguf_permuted_qk and tensor.name.endswith(("attn_k.weight", "attn_k.bias")):
            unpermute_heads = config.num_kv_heads
        weights[name] = _read_tensor(tensor, shape, keep_quantized, unpermute_heads,
                                     keep_quantized and family.name in MXFP4_FAMILIES)
    bar.close()
    weights = family.adapt_weights(weights, config, "gguf")
    check_weights(config, weights, source=path.name)
    return LoadedModel(config=config, weights=weights, tokenizer=tokenizer, path=path)
