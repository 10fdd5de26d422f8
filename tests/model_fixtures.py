"""Session-scoped default-model fixtures (a root plugin): the model loads ONCE per test run and
every package (engine, gateway, agents, scale-out) builds its engines from it."""

from __future__ import annotations

import pytest

from prefixgate.engine.loader import LoadedModel, default_model_path, load_model
from prefixgate.engine.tokenizer import Tokenizer


@pytest.fixture(scope="session")
def default_gguf_path():
    return default_model_path()


@pytest.fixture(scope="session")
def loaded_model(default_gguf_path) -> LoadedModel:
    return load_model(default_gguf_path)


@pytest.fixture(scope="session")
def tokenizer(loaded_model) -> Tokenizer:
    return loaded_model.tokenizer
