"""Fixtures for the model families: real tokenizers and chat templates, tiny random weights.

Nothing here ships in the repository. Built on first use, cached, idempotent:

* ``llama_cpp_sources()``: the vocab-only GGUFs (real tokenizers) and the chat templates from
  the PyPI sdist of llama-cpp-python (``pip download``, the one network access; later runs
  reuse the cache). The sdist carries no weights.
* ``family_fixture(name)``: a tiny random-weight model of one family, built by transformers
  from a config (so the oracle and the file hold the same weights), saved as a HF directory
  (safetensors + the real tokenizer.json + the real template) and written as a GGUF the way
  llama.cpp's converter writes that architecture (tensor names, Q/K permutation, Gemma's
  ``norm + 1``, Phi's fused tensors, MoE experts stacked), with the vocab's tokenizer metadata.

Cache: ``$PREFIXGATE_FIXTURE_DIR`` or ``~/.cache/prefixgate-fixtures``; bump ``FIXTURE_VERSION``
when what is built changes. Each entry is written to a temporary folder and renamed into place,
so an interrupted build leaves nothing half-made.
"""

from __future__ import annotations

import math
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

LLAMA_CPP_PYTHON = "llama-cpp-python==0.3.36"
FIXTURE_VERSION = 1
_MODELS_PREFIX = "vendor/llama.cpp/models/"


def fixture_root() -> Path:
    root = os.environ.get("PREFIXGATE_FIXTURE_DIR")
    return Path(root) if root else Path.home() / ".cache" / "prefixgate-fixtures"


def _build_once(target: Path, build: Callable[[Path], None]) -> Path:
    """``build(tmp)`` then rename ``tmp`` to ``target``, unless ``target`` exists already."""
    if target.is_dir():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=target.parent, prefix=f".{target.name}-"))
    try:
        build(tmp)
        tmp.rename(target)
    except OSError:
        if not target.is_dir():  # another process won the race: theirs is as good
            raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return target


def download_sdist(download: Path) -> Path:
    """The llama-cpp-python sdist (``pip download``, the one network access) into ``download``;
    returns the archive."""
    subprocess.run(
        [sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:",
         "--disable-pip-version-check", "-q", "-d", str(download), LLAMA_CPP_PYTHON],
        check=True,
    )  # fmt: skip
    (archive,) = download.glob("*.tar.gz")
    return archive


def _extract_sources(tmp: Path) -> None:
    download = tmp / "sdist"
    archive = download_sdist(download)
    (tmp / "vocab").mkdir()
    (tmp / "templates").mkdir()
    with tarfile.open(archive) as tar:
        for member in tar:
            rel = member.name.split(_MODELS_PREFIX, 1)[-1] if _MODELS_PREFIX in member.name else ""
            name = Path(rel).name
            if rel.startswith("ggml-vocab-") and name.endswith(".gguf"):
                dest = tmp / "vocab" / name
            elif rel.startswith("templates/") and name.endswith(".jinja"):
                dest = tmp / "templates" / name
            else:
                continue
            source = tar.extractfile(member)
            assert source is not None
            dest.write_bytes(source.read())
    shutil.rmtree(download)


def llama_cpp_sources() -> Path:
    """Folder with ``vocab/ggml-vocab-*.gguf`` and ``templates/*.jinja`` from the sdist."""
    name = "llama-cpp-sources-" + LLAMA_CPP_PYTHON.split("==")[1]
    return _build_once(fixture_root() / name, _extract_sources)


def vocab_gguf(name: str) -> Path:
    return llama_cpp_sources() / "vocab" / f"ggml-vocab-{name}.gguf"


def template(name: str) -> str:
    return (llama_cpp_sources() / "templates" / name).read_text(encoding="utf-8")


# ---- the families -------------------------------------------------------------------------

_SHAPE = {
    "hidden_size": 128,
    "intermediate_size": 256,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 32,
    "max_position_embeddings": 4096,
    "rms_norm_eps": 1e-6,
    "initializer_range": 0.08,  # above the default, so a wrong weight shows in the logits
    "tie_word_embeddings": False,
}


@dataclass(frozen=True)
class FamilySpec:
    """One family's tiny model: transformers classes, config, vocab, template, GGUF arch."""

    config_class: str
    model_class: str
    gguf_arch: str
    vocab: str  # ggml-vocab-<vocab>.gguf
    template: str  # templates/<template>
    config: dict[str, Any] = field(default_factory=dict)
    norm_offset: float = 0.0  # Gemma stores norm weights as offsets from 1


FAMILIES: dict[str, FamilySpec] = {
    "qwen3": FamilySpec(
        "Qwen3Config", "Qwen3ForCausalLM", "qwen3", "qwen2", "Qwen-Qwen3-0.6B.jinja",
        {"rope_theta": 1000000.0, "tie_word_embeddings": True},
    ),
    "llama3": FamilySpec(
        "LlamaConfig", "LlamaForCausalLM", "llama", "llama-bpe",
        "meta-llama-Llama-3.1-8B-Instruct.jinja",
        {
            "rope_theta": 500000.0,
            "rope_scaling": {
                "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                "high_freq_factor": 4.0, "original_max_position_embeddings": 512,
            },
        },
    ),
    "phi3": FamilySpec(
        "Phi3Config", "Phi3ForCausalLM", "phi3", "phi-3", "microsoft-Phi-3.5-mini-instruct.jinja",
        {"head_dim": None, "pad_token_id": 0},
    ),
    "phi4_mini": FamilySpec(
        # Phi-4-mini's own tokenizer is not among the sdist's vocabularies: Phi-3's stands in
        "Phi3Config", "Phi3ForCausalLM", "phi3", "phi-3", "microsoft-Phi-3.5-mini-instruct.jinja",
        {
            "head_dim": None, "pad_token_id": 0, "tie_word_embeddings": True,
            "partial_rotary_factor": 0.75, "max_position_embeddings": 131072,
            "original_max_position_embeddings": 4096,
            "rope_scaling": {
                "type": "longrope",
                "short_factor": [1.0 + 0.15 * i for i in range(12)],
                "long_factor": [4.0 + i for i in range(12)],
            },
        },
    ),
    "gemma3": FamilySpec(
        "Gemma3TextConfig", "Gemma3ForCausalLM", "gemma3", "llama-spm",
        "google-gemma-2-2b-it.jinja",
        {
            "num_hidden_layers": 6,  # llama.cpp's fixed pattern: 5 sliding layers, then 1 global
            "sliding_window": 8,  # short, so prompts of a few pages run past it
            "query_pre_attn_scalar": 32,
            "tie_word_embeddings": True,
            "final_logit_softcapping": 30.0,
            "pad_token_id": 0,
        },
        norm_offset=1.0,
    ),
    "qwen3_moe": FamilySpec(
        "Qwen3MoeConfig", "Qwen3MoeForCausalLM", "qwen3moe", "qwen2", "Qwen3-Coder.jinja",
        {
            "num_experts": 8, "num_experts_per_tok": 2, "moe_intermediate_size": 64,
            "norm_topk_prob": True, "rope_theta": 1000000.0,
        },
    ),
    "smollm3": FamilySpec(
        # SmolLM3's tokenizer is Llama 3's (llama-bpe) with its own <|im_start|> markers, which
        # this vocabulary spells as text
        "SmolLM3Config", "SmolLM3ForCausalLM", "smollm3", "llama-bpe",
        "HuggingFaceTB-SmolLM3-3B.jinja",
        # 4 layers: the last one is NoPE (no_rope_layer_interval 4)
        {"num_hidden_layers": 4, "rope_theta": 5000000.0, "tie_word_embeddings": True},
    ),
    "granite": FamilySpec(
        # Granite 3.x's tokenizer is StarCoder's 49,152 tokens plus its role markers
        # (<|start_of_role|> ...), which this vocabulary spells as text; llama.cpp tags it
        # refact, whose pre-tokenizer is starcoder's (llama-vocab.cpp)
        "GraniteConfig", "GraniteForCausalLM", "granite", "starcoder",
        "ibm-granite-granite-3.3-2B-Instruct.jinja",
        {
            "head_dim": None, "tie_word_embeddings": True, "embedding_multiplier": 12.0,
            # Granite 3.3-2B's values, the residual one rounded to 0.25 (0.22 there) so
            # that the GGUF's float32 equals the config's number exactly
            "residual_multiplier": 0.25, "attention_multiplier": 0.015625,
            "logits_scaling": 8.0,
        },
    ),
    "qwen3_5": FamilySpec(
        # 3 Gated DeltaNet layers then 1 gated full-attention layer (full_attention_interval 4);
        # 2 K heads for 4 V heads, so the GGUF's V heads are tiled as llama.cpp's converter does
        "Qwen3_5TextConfig", "Qwen3_5ForCausalLM", "qwen35", "qwen35", "Qwen3.5-4B.jinja",
        {
            "num_hidden_layers": 4, "tie_word_embeddings": True, "rope_theta": 10000000.0,
            "linear_num_key_heads": 2, "linear_num_value_heads": 4, "linear_key_head_dim": 16,
            "linear_value_head_dim": 16, "linear_conv_kernel_dim": 4,
        },
        norm_offset=1.0,
    ),
    "qwen3_5_moe": FamilySpec(
        "Qwen3_5MoeTextConfig", "Qwen3_5MoeForCausalLM", "qwen35moe", "qwen35", "Qwen3.5-4B.jinja",
        {
            "num_hidden_layers": 4, "tie_word_embeddings": True, "rope_theta": 10000000.0,
            "linear_num_key_heads": 2, "linear_num_value_heads": 4, "linear_key_head_dim": 16,
            "linear_value_head_dim": 16, "linear_conv_kernel_dim": 4,
            "num_experts": 8, "num_experts_per_tok": 2, "moe_intermediate_size": 64,
            "shared_expert_intermediate_size": 96,
        },
        norm_offset=1.0,
    ),
    "olmo2": FamilySpec(
        # stand-ins: no OLMo 2 (dolma2, cl100k-based) vocabulary or template is in the sdist;
        # llama-bpe's first 100k tokens are cl100k's, and Phi-3.5's template has the Tulu
        # <|user|> / <|assistant|> role lines OLMo 2's uses
        "Olmo2Config", "Olmo2ForCausalLM", "olmo2", "llama-bpe",
        "microsoft-Phi-3.5-mini-instruct.jinja",
        {"rope_theta": 500000.0, "pad_token_id": 0},
    ),
    "olmo3": FamilySpec(
        # OLMo 2 with sliding-window layers; the same stand-ins. 4 layers: 3 sliding (an
        # 8-token window, so prompts run past it) and a global one; llama.cpp's arch is olmo2
        "Olmo3Config", "Olmo3ForCausalLM", "olmo2", "llama-bpe",
        "microsoft-Phi-3.5-mini-instruct.jinja",
        {"num_hidden_layers": 4, "sliding_window": 8, "rope_theta": 500000.0, "pad_token_id": 0},
    ),
}  # fmt: skip


# hybrids (recurrent state + paged KV) run their own tests (tests/engine/models/test_qwen3_5.py):
# a chunk of theirs carries state slots, which the generic family tests do not hand out
HYBRID_FAMILIES = ("qwen3_5", "qwen3_5_moe")
ATTENTION_FAMILIES = {name: spec for name, spec in FAMILIES.items() if name not in HYBRID_FAMILIES}


@dataclass(frozen=True)
class FamilyFixture:
    name: str
    hf_dir: Path  # config.json, model.safetensors, tokenizer.json, chat_template.jinja
    gguf_path: Path

    def hf_model(self) -> Any:
        """The oracle: transformers on the same safetensors, fp32, eval mode."""
        from transformers import AutoModelForCausalLM

        return AutoModelForCausalLM.from_pretrained(str(self.hf_dir), dtype=torch.float32).eval()


def _vocab_size(vocab: Path) -> int:
    from gguf import GGUFReader

    return len(GGUFReader(vocab).fields["tokenizer.ggml.tokens"].data)


def _random_model(spec: FamilySpec, vocab_size: int) -> Any:
    import transformers

    settings = {**_SHAPE, "vocab_size": vocab_size, **spec.config}
    settings = {k: v for k, v in settings.items() if v is not None}
    torch.manual_seed(0)
    config = getattr(transformers, spec.config_class)(**settings)
    model = getattr(transformers, spec.model_class)(config).eval().float()
    with torch.no_grad():  # norms away from 1 so a missed norm shows in the logits
        for name, param in model.named_parameters():
            if "norm" in name:
                param.uniform_(0.5 - spec.norm_offset, 1.5 - spec.norm_offset)
    return model


def _save_tokenizer(vocab: Path, directory: Path, chat_template: str) -> None:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(vocab.parent), gguf_file=vocab.name)
    tokenizer.chat_template = chat_template
    tokenizer.save_pretrained(str(directory))


def _build_family(name: str, tmp: Path) -> None:
    from tests.family_gguf import write_family_gguf

    spec = FAMILIES[name]
    vocab = vocab_gguf(spec.vocab)
    chat_template = template(spec.template)
    model = _random_model(spec, _vocab_size(vocab))
    hf_dir = tmp / "hf"
    model.save_pretrained(str(hf_dir))
    _save_tokenizer(vocab, hf_dir, chat_template)
    if spec.gguf_arch:  # (a family without a GGUF writer yet gets its HF directory only)
        write_family_gguf(tmp / f"{name}.gguf", model.config, spec, vocab, chat_template)


def family_fixture(name: str) -> FamilyFixture:
    """The cached tiny model of family ``name`` (a key of ``FAMILIES``), built if missing."""
    target = fixture_root() / f"family-v{FIXTURE_VERSION}" / name
    _build_once(target, lambda tmp: _build_family(name, tmp))
    gguf_path = target / f"{name}.gguf"
    if FAMILIES[name].gguf_arch and not gguf_path.is_file():
        _add_gguf(name, target / "hf", gguf_path)  # an entry built before its family had one
    return FamilyFixture(name, target / "hf", gguf_path)


def _add_gguf(name: str, hf_dir: Path, gguf_path: Path) -> None:
    """Write family ``name``'s GGUF from its cached HF directory (the same weights), to a
    temporary file renamed into place."""
    from transformers import AutoConfig

    from tests.family_gguf import write_family_gguf

    spec = FAMILIES[name]
    fd, tmp = tempfile.mkstemp(dir=gguf_path.parent, prefix=f".{gguf_path.name}-")
    os.close(fd)
    try:
        write_family_gguf(Path(tmp), AutoConfig.from_pretrained(str(hf_dir)), spec,
                          vocab_gguf(spec.vocab), template(spec.template), hf_dir=hf_dir)
        os.replace(tmp, gguf_path)
    finally:
        Path(tmp).unlink(missing_ok=True)


def quantized_gguf(name: str, qtype_name: str = "Q8_0") -> Path:
    """Family ``name``'s GGUF with its 2-D matrices in ``qtype_name`` (cached beside it)."""
    from gguf import GGMLQuantizationType
    from transformers import AutoConfig

    from tests.family_gguf import write_family_gguf

    fixture = family_fixture(name)
    spec = FAMILIES[name]

    def build(tmp: Path) -> None:
        cfg = AutoConfig.from_pretrained(str(fixture.hf_dir))
        write_family_gguf(
            tmp / f"{name}-{qtype_name}.gguf", cfg, spec, vocab_gguf(spec.vocab),
            template(spec.template), hf_dir=fixture.hf_dir,
            qtype=GGMLQuantizationType[qtype_name],
        )  # fmt: skip

    target = fixture.hf_dir.parent / qtype_name
    return _build_once(target, build) / f"{name}-{qtype_name}.gguf"


def llama3_rope_freq_factors(config: Any) -> np.ndarray:
    """llama.cpp's ``rope_freqs`` for Llama 3.x scaling: one divisor per rotary pair."""
    scaling = config.rope_parameters
    dim = config.head_dim
    base = scaling["rope_theta"]
    factor, low, high = scaling["factor"], scaling["low_freq_factor"], scaling["high_freq_factor"]
    original = scaling["original_max_position_embeddings"]
    low_wavelen, high_wavelen = original / low, original / high
    freqs = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim))
    factors = []
    for freq in freqs.tolist():
        wavelen = 2 * math.pi / freq
        if wavelen < high_wavelen:
            factors.append(1.0)
        elif wavelen > low_wavelen:
            factors.append(factor)
        else:
            smooth = (original / wavelen - low) / (high - low)
            factors.append(1 / ((1 - smooth) / factor + smooth))
    return np.asarray(factors, dtype=np.float32)


def main() -> None:
    """``python -m tests.family_fixtures``: build every fixture now (``make fixtures``)."""
    for name in FAMILIES:
        print(family_fixture(name).hf_dir.parent)


if __name__ == "__main__":
    main()
