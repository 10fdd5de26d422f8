"""The swarm against the real gateway (fixture ``live_gateway_url`` from the gateway tests)."""

from __future__ import annotations

import asyncio

import pytest

from prefixgate.agents.report import summarize
from prefixgate.agents.runner import Endpoint, run_workload
from prefixgate.agents.workload import SwarmConfig, build_workload

pytestmark = pytest.mark.slow


@pytest.fixture
def gateway_url(request) -> str:
    try:
        return request.getfixturevalue("live_gateway_url")
    except pytest.FixtureLookupError:
        pytest.skip("needs the `live_gateway_url` fixture (a running prefixgate gateway on the "
                    "default model), which tests/conftest.py does not provide yet")


def test_tiny_swarm_hits_the_cache_and_stays_under_the_ideal(gateway_url):
    config = SwarmConfig(groups=2, agents_per_group=2, turns=2, system_tokens=256,
                         task_tokens=32, followup_tokens=32, max_tokens=4, concurrency=4)
    result = asyncio.run(run_workload(build_workload(config), Endpoint("gateway", gateway_url),
                                      page_size=16))
    assert all(r.ok for r in result.records), [(r.error_kind, r.error) for r in result.records]
    assert result.tokenize == "ok"
    assert all(r.tokenized_len == r.prompt_tokens for r in result.records)
    summary = summarize([result])
    assert summary.achieved_hit_rate is not None, "the gateway must report cached_tokens"
    assert 0 < summary.achieved_hit_rate <= summary.ideal_hit_rate
