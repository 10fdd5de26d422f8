"""Load only what a router needs to hash prompts like a replica: the tokenizer (with its chat
template) and the model id that enters every block hash. No weights are read.

GGUF: the metadata is memory-mapped and parsed by the same functions as the full loader, so
the tokenizer and name are identical to the replica's. HF directory: config.json and the
tokenizer files, as the full loader reads them.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from prefixgate.engine.loader.default_model import default_model_path
from prefixgate.engine.loader.gguf import _read_config, _read_vocab, require_gguf_file
from prefixgate.engine.loader.gguf_reader import FastGGUFReader
from prefixgate.engine.loader.hf import _load_tokenizer, _read_json, config_from_hf
from prefixgate.engine.tokenizer import Tokenizer


@dataclass(frozen=True, slots=True)
class TokenizerOnly:
    """The tokenizer of a model and the id its replicas hash with (``LoadedModel.name``)."""

    tokenizer: Tokenizer
    model_id: str
    max_model_len: int
    path: Path


def load_tokenizer_only(model: str | Path | None = None) -> TokenizerOnly:
    """Read the tokenizer and model id of ``model`` (a ``.gguf`` file, a HF directory, or None
    for the default model) without loading its weights.

    Raises:
        FileNotFoundError: the path does not exist.
        UnsupportedModelError: not a GGUF file / HF directory, or an unsupported architecture.
    """
    path = default_model_path() if model is None else Path(model).expanduser()
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise FileNotFoundError(f"not a Hugging Face model directory (no config.json): {path}")
        raw = _read_json(path / "config.json")
        config = config_from_hf(raw, raw.get("_name_or_path") or path.name)
        tokenizer = _load_tokenizer(path)
    elif path.is_file():
        require_gguf_file(path)
        reader = FastGGUFReader(path)
        shapes = {t.name: [int(d) for d in t.shape] for t in reader.tensors}
        config = _read_config(reader, path, shapes)
        tokenizer = Tokenizer.from_gguf_vocab(_read_vocab(reader, path))
    else:
        raise FileNotFoundError(f"model not found: {path}")
    return TokenizerOnly(tokenizer, config.name, config.max_position_embeddings, path)
