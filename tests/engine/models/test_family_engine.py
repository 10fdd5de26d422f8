"""The newer families through the whole engine: scheduler, prefix cache, speculation.

A second request sharing a long prefix is served from cached pages (Gemma 3's sliding layers
read them through the window) and decodes exactly what a cold engine without prefix caching
or speculation decodes.
"""

from __future__ import annotations

import pytest

from prefixgate.engine.api import GenerationRequest, SamplingParams
from prefixgate.engine.build import create_llm_engine
from prefixgate.engine.config import EngineConfig
from tests.engine.test_engine import run, tokens

pytestmark = pytest.mark.slow

SYSTEM = (
    "You are one agent of a swarm that edits a large codebase. Read files before you change "
    "them, keep each change small, run the tests after every edit, and report what you did."
)
TASKS = ["Rename the cache module.", "Add a test for the scheduler."]


def _engine(loaded, **overrides):
    config = EngineConfig(**{"num_pages": 64, "page_size": 16, "device": "cpu", **overrides})
    return create_llm_engine(config, loaded=loaded)[0]


@pytest.mark.parametrize("name", ["gemma3", "qwen3_moe"])
def test_prefix_hit_and_speculation_decode_like_a_cold_engine(family_case, name):
    loaded = family_case(name).loaded
    # the shared text opens the user turn (Gemma's template refuses a system role)
    prompts = [
        tuple(loaded.tokenizer.apply_chat_template(
            [{"role": "user", "content": f"{SYSTEM}\n\n{task}"}]
        ))
        for task in TASKS
    ]  # fmt: skip
    greedy = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)
    warm = _engine(loaded, num_speculative_tokens=4)
    run(warm, [GenerationRequest(prompts[0], greedy, request_id="first")])
    second = run(warm, [GenerationRequest(prompts[1], greedy, request_id="second")])["second"]
    assert second[-1].usage.cached_tokens >= 32  # the shared system prompt's full pages
    cold = _engine(loaded, enable_prefix_caching=False, num_speculative_tokens=0)
    alone = run(cold, [GenerationRequest(prompts[1], greedy, request_id="alone")])["alone"]
    assert tokens(second) == tokens(alone)
    assert len(tokens(alone)) == 10
