"""The router's tokenizer-only load gives the replicas' tokenizer and model id, no weights."""

from __future__ import annotations

import pytest

from prefixgate.engine.loader.tokenizer_only import load_tokenizer_only
from prefixgate.engine.model_config import UnsupportedModelError

pytestmark = pytest.mark.slow


def test_same_tokenizer_and_model_id_as_the_full_loader(loaded_model):
    only = load_tokenizer_only(None)
    assert only.model_id == loaded_model.name
    assert only.path == loaded_model.path
    messages = [{"role": "system", "content": "Be brief."},
                {"role": "user", "content": "Ünïcode, emoji 🚀 and\ttabs."}]
    assert (only.tokenizer.apply_chat_template(messages)
            == loaded_model.tokenizer.apply_chat_template(messages))
    assert only.tokenizer.encode("plain text", True) == loaded_model.tokenizer.encode(
        "plain text", True)


def test_bad_paths_name_the_problem(tmp_path):
    with pytest.raises(FileNotFoundError, match="model not found"):
        load_tokenizer_only(tmp_path / "missing.gguf")
    bogus = tmp_path / "bogus.gguf"
    bogus.write_bytes(b"NOPE" + bytes(64))
    with pytest.raises(UnsupportedModelError, match="not a GGUF file"):
        load_tokenizer_only(bogus)
    with pytest.raises(FileNotFoundError, match="no config.json"):
        load_tokenizer_only(tmp_path)
