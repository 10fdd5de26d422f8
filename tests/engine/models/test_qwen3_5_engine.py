"""Qwen3.5 hybrids through the whole engine: prefix hits restore pages and a state checkpoint,
at the granularity of a pure-attention model, and decode exactly what a cold engine decodes."""

from __future__ import annotations

import pytest

from prefixgate.engine.api import GenerationRequest, SamplingParams
from prefixgate.engine.build import create_llm_engine
from prefixgate.engine.config import EngineConfig
from tests.engine.test_engine import run, tokens

pytestmark = pytest.mark.slow

GREEDY = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)


def _engine(loaded, **overrides):
    config = EngineConfig(**{"num_pages": 48, "page_size": 16, "device": "cpu",
                             "num_state_slots": 12, **overrides})
    return create_llm_engine(config, loaded=loaded)[0]


def _cached(engine, prompt, request_id):
    out = run(engine, [GenerationRequest(tuple(prompt), GREEDY, request_id=request_id)])[request_id]
    engine.scheduler.cache.check_integrity()
    return out[-1].usage.cached_tokens, tokens(out)


@pytest.mark.parametrize("name", ["qwen3_5", "qwen3_5_moe"])
def test_hit_at_every_block_decodes_like_a_cold_engine(family_case, name):
    loaded = family_case(name).loaded
    base = list(loaded.tokenizer.apply_chat_template([{"role": "user", "content": "x"}]))
    shared = (base * 8)[:40]  # a 40-token shared prefix: 2 full 16-token blocks
    first, second = shared + [11, 12, 13], shared + [21, 22, 23, 24, 25]
    warm = _engine(loaded)
    assert _cached(warm, first, "first")[0] == 0
    hit, decoded = _cached(warm, second, "second")
    assert hit == 32  # as a pure-attention model: both full blocks of the shared prefix
    cold = _engine(loaded, enable_prefix_caching=False)
    assert _cached(cold, second, "cold")[1] == decoded
    # a growing conversation: the next turn hits up to the last full block of the previous
    # turn's tokens (prompt and output), checkpointed on the way
    turn = second + decoded + [31, 32, 33]
    hit, decoded = _cached(warm, turn, "turn")
    assert hit == (len(second) + len(decoded) - 1) // 16 * 16
    assert _cached(cold, turn, "cold-turn")[1] == decoded
    stats = warm.scheduler.cache.state
    assert stats.num_saved > 0 and stats.num_working == 0


def test_short_prefix_below_any_large_block_hits(family_case):
    # vLLM's align mode needs 528-token blocks: a 20-token prefix never hits there
    loaded = family_case("qwen3_5").loaded
    warm = _engine(loaded)
    _cached(warm, list(range(100, 120)) + [1], "a")
    assert _cached(warm, list(range(100, 120)) + [2, 3], "b")[0] == 16


def test_state_slots_bound_admission_and_checkpoints_evict(family_case):
    """Fewer slots than requests: requests wait for a working slot, checkpoints are evicted
    LRU to make room, nothing leaks, and outputs equal the cold engine's."""
    loaded = family_case("qwen3_5").loaded
    tight = _engine(loaded, num_state_slots=3)
    prompts = [tuple(range(200 + 7 * i, 240 + 7 * i)) for i in range(5)]
    outs = run(tight, [GenerationRequest(p, GREEDY, request_id=str(i)) for i, p in enumerate(prompts)])
    tight.scheduler.cache.check_integrity()
    cold = _engine(loaded, enable_prefix_caching=False)
    for i, p in enumerate(prompts):
        assert tokens(outs[str(i)]) == _cached(cold, p, f"c{i}")[1]
    assert tight.scheduler.cache.state.num_working == 0 and tight.scheduler.cache.state.num_evicted > 0


def test_tier_load_restores_pages_and_checkpoint_like_a_recompute(family_case):
    """Turn 1's pages are evicted to the host tier by other traffic while its checkpoints stay
    in the state pool; turn 2 loads the pages back, restores the checkpoint and decodes what
    an engine without the tier (which recomputes) decodes."""
    from prefixgate.cache.tier import HostTier, entry_slot_bytes
    from prefixgate.engine.kv_tier import KVTier

    loaded = family_case("qwen3_5").loaded
    paused = list(range(300, 380))  # five full blocks
    others = [list(range(500 + 90 * i, 580 + 90 * i)) for i in range(3)]

    def session(engine):
        first = _cached(engine, paused, "turn1")[1]
        for i, other in enumerate(others):
            _cached(engine, other, f"o{i}")
        if engine.tier is not None:
            engine.tier.flush()
        hit, back = _cached(engine, paused, "turn2")
        assert back == first
        return hit, back

    plain_hit, plain = session(_engine(loaded, num_pages=12, watermark=0.0, num_state_slots=64))
    engine = _engine(loaded, num_pages=12, watermark=0.0, num_state_slots=64)
    pool = engine.runner.kv_pool
    page_bytes = pool[:, :, 0].numel() * pool.element_size()
    store = HostTier(64 * entry_slot_bytes(page_bytes), entry_slot_bytes(page_bytes))
    engine.attach_tier(KVTier(store, pool, load_timeout_s=30.0))
    hit, out = session(engine)
    assert out == plain
    assert engine.tier.stats().pages_loaded > 0 and hit == 64 > plain_hit


def test_n_choices_fork_the_state(family_case):
    """n > 1: the prompt runs once, each choice's state is a copy of it (made between steps),
    and every greedy choice decodes what a single cold request decodes."""
    loaded = family_case("qwen3_5").loaded
    prompt = tuple(range(700, 745))
    warm = _engine(loaded)
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True, n=3)
    out = run(warm, [GenerationRequest(prompt, params, request_id="n3")])["n3"]
    warm.scheduler.cache.check_integrity()
    cold = _engine(loaded, enable_prefix_caching=False)
    alone = _cached(cold, list(prompt), "alone")[1]
    assert [tokens(out, choice) for choice in range(3)] == [alone] * 3
    assert warm.scheduler.cache.state.num_working == 0


def test_evicted_checkpoints_spill_to_host_memory_and_come_back(family_case):
    """Slots for a handful of checkpoints only: a paused conversation's checkpoints are
    evicted by other traffic into the state tier (host memory); when it returns, its pages
    are still in the pool and its last checkpoint comes back from the tier, so it hits as far
    as with ample slots and decodes what a cold engine decodes."""
    from prefixgate.engine.state_tier import StateTier

    loaded = family_case("qwen3_5").loaded
    paused = list(range(300, 380))  # five full blocks
    others = [list(range(500 + 50 * i, 540 + 50 * i)) for i in range(4)]
    engine = _engine(loaded, num_pages=64, num_state_slots=4)
    tier = StateTier(engine.runner.states, 32)
    engine.scheduler.cache.attach_state_tier(tier)
    first = _cached(engine, paused, "turn1")[1]
    for i, other in enumerate(others):
        _cached(engine, other, f"o{i}")
    assert tier.num_spilled > 0
    hit, back = _cached(engine, paused + first[:3] + [7], "turn2")
    assert tier.num_loaded > 0 and hit >= 80
    cold = _engine(loaded, enable_prefix_caching=False)
    assert _cached(cold, paused + first[:3] + [7], "cold")[1] == back
    engine.scheduler.cache.check_integrity()
