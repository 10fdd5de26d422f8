"""The step pacer (engine/step_pacing.py): what it measures of the engine's steps, and
the cap it puts on a step's prefill while streams decode (Scheduler.step_budget)."""

import random

import pytest

from prefixgate.cache import KVCacheManager
from prefixgate.engine.config import EngineConfig, decode_slowdown
from prefixgate.engine.step_pacing import StepPacer
from tests.engine.test_scheduler import make_scheduler, seq, step


def _feed(pacer: StepPacer, steps: int, decode_s: float, unit_s: float, seed: int = 0) -> None:
    """Alternating steps of decodes alone and with prefill, on a noisy clock."""
    rng = random.Random(seed)
    for i in range(steps):
        units = 0.0 if i % 3 == 0 else rng.uniform(5, 300)
        pacer.observe(8, units, (decode_s + unit_s * units) * rng.uniform(0.97, 1.03))


def test_it_measures_the_step_and_caps_the_prefill():
    pacer = StepPacer(2.0)
    _feed(pacer, 60, decode_s=0.028, unit_s=0.0008)
    # a 28 ms step of decodes; doubling it leaves 28 ms of prefill = 35 units
    assert pacer.prefill_units(8) == pytest.approx(35, rel=0.15)
    triple = StepPacer(3.0, pacer.decode_s, pacer.added_s, pacer.added_units)
    assert triple.prefill_units(8) == pytest.approx(2 * pacer.prefill_units(8))


def test_no_cap_until_both_kinds_of_step_were_measured():
    pacer = StepPacer(2.0)
    for _ in range(5):
        pacer.observe(8, 0.0, 0.03)  # decodes only: what a unit costs is unknown
    assert pacer.prefill_units(8) is None
    pacer.observe(8, 50.0, 0.07)
    assert pacer.prefill_units(8) == pytest.approx(0.03 / (0.04 / 50))
    # a 170 ms stall in a step with two units: counted as at most 3x what they cost
    pacer.observe(8, 2.0, 0.2)
    unit_s = (0.7 * 0.3 * 0.04 + 0.3 * 3 * 0.0008 * 2) / (0.7 * 0.3 * 50 + 0.3 * 2)
    assert pacer.prefill_units(8) == pytest.approx(0.03 / unit_s)
    assert pacer.prefill_units(0) is None  # nothing decodes: nothing to pace
    fresh = StepPacer(2.0)
    fresh.observe(0, 300.0, 0.3)  # a prefill-only step says nothing about decodes
    assert fresh.prefill_units(8) is None


def test_the_cap_follows_a_unit_getting_dearer():
    """A prompt prefilled deeper costs more per unit: the last steps weigh most."""
    pacer = StepPacer(2.0)
    _feed(pacer, 60, decode_s=0.028, unit_s=0.0008)
    before = pacer.prefill_units(8)
    _feed(pacer, 30, decode_s=0.028, unit_s=0.0016, seed=1)
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
    pacer = StepPacer(2.0, decode_s=0.02, added_s=0.1, added_units=10)  # dear units: 2 a step
    s = make_scheduler(KVCacheManager(256, 4, watermark=0), max_num_batched_tokens=256,
                  decode_step_budget=32, short_prefill_budget=1, pacer=pacer)
    streams = [seq(range(10 * i, 10 * i + 3), f"s{i}") for i in range(4)]
    for x in streams:
        s.add(x)
    step(s)
    prompt = seq(range(500, 600), "prompt")
    s.add(prompt)
    assert s.step_budget() == 4 + 2  # below the token budget and below a page
    for _ in range(3):
        before = prompt.num_computed
        out = step(s)
        assert prompt.num_computed > before  # the oldest prefill moves every step
    # the engine feeds it each step: decode rows and prefill units, as the schedule counted
    seen = []
    s.pacer = _Recording(2.0)
    s.pacer.seen = seen
    s.observe_step(out, 0.05)
    prompt_tokens = sum(c.num_tokens for c in out.chunks if c.seq is prompt)
    assert seen == [(4, prompt_tokens, 0.05)]


class _Recording(StepPacer):
    def observe(self, decode_rows: int, prefill_units: float, seconds: float) -> None:
        self.seen.append((decode_rows, prefill_units, seconds))
