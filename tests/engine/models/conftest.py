"""Per-family fixtures: the cached tiny model (tests/family_fixtures.py), loaded once per run.

``family_case(name)`` (module-scoped) gives the HF-loaded runner, transformers on the same safetensors (the
oracle) and a chat prompt rendered by the family's real template with its real tokenizer.
"""

from __future__ import annotations

import functools
from typing import Any, NamedTuple

import pytest

from prefixgate.engine.loader import LoadedModel, load_model
from prefixgate.engine.runner import ModelRunner
from tests.family_fixtures import FamilyFixture, family_fixture

NUM_PAGES = 96
PAGE_SIZE = 16
MESSAGES = [
    {
        "role": "user",
        "content": "Write a haiku about paged caches, then explain in one sentence why prefix "
        "sharing saves compute for a swarm of agents.",
    }
]


class FamilyCase(NamedTuple):
    fixture: FamilyFixture
    loaded: LoadedModel
    runner: ModelRunner
    oracle: Any  # transformers' model on the same weights
    prompt: list[int]


def make_runner(loaded: LoadedModel) -> ModelRunner:
    return ModelRunner.from_loaded(
        loaded, num_pages=NUM_PAGES, page_size=PAGE_SIZE, device="cpu", dtype="fp32"
    )


def _case(name: str) -> FamilyCase:
    fixture = family_fixture(name)
    loaded = load_model(fixture.hf_dir)
    prompt = loaded.tokenizer.apply_chat_template(MESSAGES)
    return FamilyCase(fixture, loaded, make_runner(loaded), fixture.hf_model(), prompt)


@pytest.fixture(scope="module")
def family_case():
    """``family_case(name)``: built once per test module, then released (six families'
    models, runners and oracles do not all stay in memory for the whole run)."""
    return functools.cache(_case)
