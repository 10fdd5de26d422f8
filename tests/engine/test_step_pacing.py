"""The step pacer (gateway/engine/step_pacing.py): its online step-time fit, and the cap it puts
on a step's prefill while streams decode (Scheduler.step_budget)."""

import random

import pytest

from prefixgate.cache import KVCacheManager
from prefixgate.gateway.engine.config import EngineConfig, decode_slowdown
from prefixgate.gateway.engine.scheduler import Scheduler
from prefixgate.gateway.engine.step_pacing import MIN_STEPS, StepPacer
from tests.engine.test_scheduler import seq, step


def _feed(pacer: StepPacer, steps: int, base: float, per_decode: float, per_unit: float,
          seed: int = 0) -> None:
    rng = random.Random(seed)
    for _ in range(steps):
        decodes = rng.randrange(1, 17)
        units = rng.choice([0.0, rng.uniform(5, 300)])
        t = base + per_decode * decodes + per_unit * units
        pacer.observe(decodes, units, t * rng.uniform(0.97, 1.03))  # a noisy clock


def test_the_fit_recovers_the_step_time_and_caps_the_prefill():
    pacer = StepPacer(2.0)
    _feed(pacer, 200, base=0.020, per_decode=0.001, per_unit=0.0008)
    # 8 decodes: a 28 ms step; doubling it leaves 28 ms of prefill = 35 units
    assert pacer.prefill_units(8) == pytest.approx(35, rel=0.1)
    assert pacer.prefill_units(16) == pytest.approx(45, rel=0.1)
    assert StepPacer(3.0, pacer.theta, pacer.cov, pacer.steps, 1, 1).prefill_units(8) == (
        pytest.approx(2 * pacer.prefill_units(8)))


def test_no_cap_until_the_fit_has_seen_both_kinds_of_step():
    pacer = StepPacer(2.0)
    for _ in range(MIN_STEPS * 3):
        pacer.observe(8, 0.0, 0.03)  # decodes only: what a unit costs is unknown
    assert pacer.prefill_units(8) is None
    for _ in range(MIN_STEPS):
        pacer.observe(8, 50.0, 0.07)
    assert pacer.prefill_units(8) is not None
    fresh = StepPacer(2.0)
    fresh.observe(8, 0.0, 0.03)
    fresh.observe(8, 50.0, 0.07)
    assert fresh.prefill_units(8) is None  # too few steps to trust


def test_the_cap_follows_a_unit_getting_dearer():
    """A prompt prefilled deeper costs more per unit: recent steps weigh most."""
    pacer = StepPacer(2.0)
    _feed(pacer, 100, base=0.020, per_decode=0.001, per_unit=0.0008)
    before = pacer.prefill_units(8)
    _feed(pacer, 60, base=0.020, per_decode=0.001, per_unit=0.0016, seed=1)
    assert pacer.prefill_units(8) == pytest.approx(before / 2, rel=0.15)


def test_slowdown_is_validated_and_off_by_default():
    with pytest.raises(ValueError):
        StepPacer(1.0)
    with pytest.raises(ValueError):
        EngineConfig(decode_slowdown=0.5)
    assert decode_slowdown(EngineConfig(), "cpu") is None
    assert decode_slowdown(EngineConfig(decode_slowdown=0), "cpu") is None
    assert decode_slowdown(EngineConfig(decode_slowdown=2), "cpu") == 2


def test_a_paced_step_carries_less_than_a_page_and_the_prompt_still_moves():
    pacer = StepPacer(2.0)
    _feed(pacer, 100, base=0.020, per_decode=0.001, per_unit=0.02)  # dear units: ~1 a step
    s = Scheduler(KVCacheManager(256, 4, watermark=0), max_num_batched_tokens=256,
                  decode_step_budget=32, short_prefill_budget=1, pacer=pacer)
    streams = [seq(range(10 * i, 10 * i + 3), f"s{i}") for i in range(4)]
    for x in streams:
        s.add(x)
    step(s)
    prompt = seq(range(500, 600), "prompt")
    s.add(prompt)
    assert s.step_budget() == 4 + int(pacer.prefill_units(4))  # below the token budget
    for _ in range(3):
        before = prompt.num_computed
        out = step(s)
        assert sum(c.num_tokens for c in out.chunks if c.seq is prompt) >= 1
        assert prompt.num_computed > before
    # the engine feeds it: a step's decode rows and prefill units
    seen = pacer.steps
    s.observe_step(out, 0.05)
    assert pacer.steps == seen + 1
