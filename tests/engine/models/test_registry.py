"""models/registry.py: every family registered once, and what an unsupported model is told."""

from __future__ import annotations

import pytest

from prefixgate.engine.loader.hf import config_from_hf
from prefixgate.engine.model_config import UnsupportedModelError
from prefixgate.engine.models import build_model, families, family_for
from prefixgate.engine.models.registry import ModelFamily, register_family


def test_families_are_registered_by_both_spellings():
    assert set(families()) >= {"llama", "qwen2", "qwen3", "qwen3_moe", "gemma3", "phi3"}
    assert family_for("qwen3moe") is family_for("qwen3_moe")
    assert family_for("gemma3") is family_for("gemma3_text")


def test_unsupported_architecture_names_what_is_supported():
    with pytest.raises(UnsupportedModelError) as info:
        config_from_hf({"model_type": "falcon_h1"}, "m")
    message = str(info.value)
    assert "'falcon_h1' is not supported" in message
    for name in ("llama", "qwen3", "qwen3_moe", "gemma3_text", "phi3"):
        assert name in message


def test_unsupported_architecture_names_the_closest_family_when_one_is_close():
    for arch, family in (("granitemoe", "granite"), ("gemma2", "gemma3"), ("mixtral", "qwen3_moe")):
        with pytest.raises(UnsupportedModelError) as info:
            config_from_hf({"model_type": arch}, "m")
        message = str(info.value)
        assert f"'{arch}' is not supported; supported: llama," in message
        assert f"the closest supported family is '{family}' (" in message
    with pytest.raises(UnsupportedModelError, match="did you mean 'qwen3'"):
        family_for("Qwen3")
    # nothing is close to these: no family is named
    for arch in ("falcon_h1", "llama4"):
        with pytest.raises(UnsupportedModelError) as info:
            family_for(arch)
        assert "closest" not in str(info.value) and "did you mean" not in str(info.value)


def test_the_dense_families_of_issue_41_are_configurations():
    for arch in ("smollm3", "granite", "olmo2"):
        assert family_for(arch).name == arch
        assert family_for(arch).model_class.__name__ == "DecoderModel"
    assert family_for("olmo3") is family_for("olmo2")  # OLMo 2 with sliding-window layers


def test_an_architecture_cannot_be_claimed_twice():
    with pytest.raises(ValueError, match="registered twice"):
        register_family(ModelFamily("other", object, ("qwen3",), ()))


def test_build_model_uses_the_family_class():
    assert build_model.__module__.endswith("models")
    assert family_for("qwen2").model_class.__name__ == "DecoderModel"
    assert family_for("phi3").model_class.__name__ == "DecoderModel"
    assert family_for("gemma3").model_class.__name__ == "DecoderModel"
