"""Per-family fixtures: the cached tiny model (tests/family_fixtures.py), loaded once per run.

``family_case(name)`` gives the HF-loaded runner, transformers on the same safetensors (the
oracle) and a chat prompt rendered by the family's real template with its real tokenizer.
"""

from __future__ import annotations

import functools
from typing import Any, NamedTuple

import pytest
import torch

from prefixgate.gateway.engine.loader import LoadedModel, load_model
from prefixgate.gateway.engine.runner import ModelRunner
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
        loaded, num_pages=NUM_PAGES, page_size=PAGE_SIZE, device="cpu", dtype=torch.float32
    )


@functools.cache
def _case(name: str) -> FamilyCase:
    fixture = family_fixture(name)
    loaded = load_model(fixture.hf_dir)
    prompt = loaded.tokenizer.apply_chat_template(MESSAGES)
    return FamilyCase(fixture, loaded, make_runner(loaded), fixture.hf_model(), prompt)


@pytest.fixture(scope="session")
def family_case():
    return _case
