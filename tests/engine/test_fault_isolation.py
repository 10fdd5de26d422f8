"""One bad request harms no one (invariant 7), on the real default model.

A poison request inside a batch of 16 greedy streams fails alone with a clean error, wherever it
breaks the step (sampler, forward, detokenizer); the 16 finish token-for-token and text-for-text
as in a run without it, a constrained row's matcher is advanced once per token, and no page
leaks. Only a failure of the model itself fails everything, and the engine then recovers to a
clean state and keeps serving. The poisons are injected faults: every known one is rejected
at admission now (the last test), so a real one would be a bug still to find.
"""

from __future__ import annotations

import asyncio

import pytest

from prefixgate.engine import step_sampling
from prefixgate.engine.api import (
    EngineError,
    GenerationRequest,
    InvalidRequestError,
    SamplingParams,
)
from prefixgate.engine.async_engine import AsyncEngine
from tests.engine.test_constrained import JSON, valid
from tests.engine.test_engine import TASKS, chat, run

POISON_SEED = 4242


def tokens(deltas) -> list[int]:
    return [t for d in deltas if not isinstance(d, EngineError) for t in d.token_ids]


def text(deltas) -> str:
    return "".join(d.text for d in deltas if not isinstance(d, EngineError))


def batch(tokenizer, tag: str) -> list[GenerationRequest]:
    requests = [GenerationRequest(chat(tokenizer, t), SamplingParams(max_tokens=12, temperature=0),
                                  request_id=f"{tag}{i}") for i, t in enumerate(TASKS[:15])]
    # a constrained row: a sampler re-run must not advance its matcher twice
    requests.append(GenerationRequest(chat(tokenizer, "Weather in Oslo for 3 days, JSON."),
                                      SamplingParams(max_tokens=48, temperature=0),
                                      request_id=f"{tag}15", grammar=JSON))
    return requests


@pytest.fixture(scope="module")
def baseline(make_engine, tokenizer) -> dict[int, tuple[list[int], str]]:
    engine = make_engine(num_pages=512)
    out = run(engine, batch(tokenizer, "b"))
    return {i: (tokens(out[f"b{i}"]), text(out[f"b{i}"])) for i in range(16)}


def assert_unharmed(engine, out, baseline, tag: str) -> None:
    for i in range(16):
        deltas = out[f"{tag}{i}"]
        assert not any(isinstance(d, EngineError) for d in deltas), (i, deltas[-1])
        assert (tokens(deltas), text(deltas)) == baseline[i], i
        assert deltas[-1].usage is not None
    valid(out[f"{tag}15"])
    stats = engine.scheduler.cache.stats()
    assert stats.pages_used == 0 and stats.num_sequences == 0 and engine.num_requests == 0
    engine.scheduler.cache.check_integrity()


def poison_error(deltas) -> EngineError:
    assert isinstance(deltas[-1], EngineError) and deltas[-1].code == "request_failed", deltas[-1:]
    assert sum(isinstance(d, EngineError) for d in deltas) == 1
    return deltas[-1]


def test_sampler_poison_fails_alone(make_engine, tokenizer, baseline, monkeypatch):
    real = step_sampling.sample
    calls = {"batched_failures": 0}

    def sample(logits, rows, mask=None):
        # the poison's row breaks the sampler once it has streamed two tokens
        if any(r.params.seed == POISON_SEED and len(r.output_ids) >= 2 for r in rows):
            calls["batched_failures"] += len(rows) > 1
            raise RuntimeError("injected sampler fault")
        return real(logits, rows, mask)

    monkeypatch.setattr(step_sampling, "sample", sample)
    engine = make_engine(num_pages=512)
    poison = GenerationRequest(chat(tokenizer, "I am the poison."),
                               SamplingParams(max_tokens=12, temperature=0, seed=POISON_SEED), request_id="p")
    out = run(engine, [*batch(tokenizer, "s")[:8], poison, *batch(tokenizer, "s")[8:]])
    assert calls["batched_failures"] == 1
    assert len(tokens(out["p"])) == 2  # streamed, then cut cleanly
    poison_error(out["p"])
    assert_unharmed(engine, out, baseline, "s")


def test_forward_poison_is_bisected_out(make_engine, tokenizer, baseline, monkeypatch):
    # one token a step (no drafts): the fault is placed by the poison's decode position
    engine = make_engine(num_pages=512, num_speculative_tokens=0)
    poison_prompt = tuple(tokenizer.encode(" ".join(["Poison paragraph."] * 120)))  # far longer
    assert len(poison_prompt) > 200 + 64
    real = engine.runner.execute
    calls = {"failed": 0}

    def execute(chunks, copy_pairs=()):
        # only the poison ever decodes past its prompt (the others stop near 100 tokens)
        if any(c.start_pos >= len(poison_prompt) + 3 for c in chunks):
            calls["failed"] += 1
            raise RuntimeError("injected forward fault")
        return real(chunks, copy_pairs)

    monkeypatch.setattr(engine.runner, "execute", execute)
    poison = GenerationRequest(poison_prompt, SamplingParams(max_tokens=12, temperature=0), request_id="p")
    requests = batch(tokenizer, "f")
    out = run(engine, [*requests[:5], poison, *requests[5:]])
    poison_error(out["p"])
    assert len(tokens(out["p"])) == 4  # the chunk after its 4th token fails
    assert 2 <= calls["failed"] <= 2 * 17 .bit_length() + 2  # the whole step, then one path down
    assert_unharmed(engine, out, baseline, "f")


def test_detokenizer_poison_fails_alone(make_engine, tokenizer, baseline):
    engine = make_engine(num_pages=512)

    class BrokenDecoder:
        def feed(self, token_id: int) -> str:
            raise UnicodeDecodeError("utf-8", b"\xff", 0, 1, "injected")

        def flush(self) -> str:
            return ""

    out: dict[str, list] = {r.request_id: [] for r in batch(tokenizer, "d")}
    out["p"] = []
    for r in batch(tokenizer, "d")[:3] + [GenerationRequest(chat(tokenizer, "poison"), SamplingParams(
            max_tokens=12, temperature=0), request_id="p")] + batch(tokenizer, "d")[3:]:
        engine.add_request(r, out[r.request_id].append)
    engine.output.requests["p"].seqs[0].state.decoder = BrokenDecoder()
    while engine.has_work():
        engine.step()
    poison_error(out["p"])
    assert_unharmed(engine, out, baseline, "d")


def test_model_failure_fails_all_then_recovers(make_engine, tokenizer, monkeypatch):
    engine = make_engine(num_pages=512)
    real = engine.runner.execute
    broken = {"on": False, "calls": 0}

    def execute(chunks, copy_pairs=()):
        if broken["on"]:
            broken["calls"] += 1
            raise RuntimeError("injected device fault")
        return real(chunks, copy_pairs)

    monkeypatch.setattr(engine.runner, "execute", execute)
    front = AsyncEngine(engine, model_name="test")
    prompts = [chat(tokenizer, t) for t in TASKS[:6]]

    async def one(i: int, tag: str) -> list[int] | EngineError:
        request = GenerationRequest(prompts[i], SamplingParams(max_tokens=24, temperature=0),
                                    request_id=f"{tag}{i}")
        got: list[int] = []
        try:
            async for delta in front.generate(request):
                got += delta.token_ids
                if len(got) == 3 and tag == "x":
                    broken["on"] = True  # the device dies mid-decode, for every row
        except EngineError as exc:
            return exc
        return got

    async def main():
        await front.start()
        try:
            expected = await asyncio.gather(*(one(i, "e") for i in range(6)))
            failed = await asyncio.gather(*(one(i, "x") for i in range(6)))
            assert broken["calls"] <= 2 * 6 .bit_length() + 3  # bisection gives up early
            broken["on"] = False
            assert front.wait_idle(30)
            again = await asyncio.gather(*(one(i, "a") for i in range(6)))
            return expected, failed, again
        finally:
            await front.shutdown()

    expected, failed, again = asyncio.run(main())
    assert all(isinstance(r, list) and len(r) == 24 for r in expected)
    assert all(isinstance(r, EngineError) and "internal error" in r.message for r in failed)
    assert again == expected  # serving again, and exactly as before
    stats = engine.scheduler.cache.stats()
    assert stats.pages_used == 0 and stats.num_sequences == 0
    engine.scheduler.cache.check_integrity()


@pytest.fixture(scope="module")
def small_engine(make_engine):
    return make_engine(num_pages=16)


@pytest.mark.parametrize(("field", "value"), [
    ("top_k", 2**63), ("top_k", None), ("stop_token_ids", None), ("seed", 2**63),
    ("temperature", float("nan")), ("repetition_penalty", float("inf")),
    ("presence_penalty", float("nan")),
])
def test_known_poisons_are_rejected_at_admission(small_engine, field, value):
    engine = small_engine
    vocab = engine.runner.vocab_size
    value = {("top_k", None): vocab + 1, ("stop_token_ids", None): (vocab,)}.get((field, value), value)
    with pytest.raises(InvalidRequestError) as info:
        engine.validate(GenerationRequest((1, 2, 3), SamplingParams(**{field: value})))
    assert info.value.param == field
    # just inside: accepted
    inside = {"top_k": vocab, "stop_token_ids": (vocab - 1,), "seed": 2**63 - 1, "temperature": 2.0,
              "repetition_penalty": 10.0, "presence_penalty": -2.0}[field]
    engine.validate(GenerationRequest((1, 2, 3), SamplingParams(**{field: inside})))


@pytest.mark.parametrize("where", ["masks", "drafting"])
def test_a_grammar_fault_in_drafts_harms_no_other_request(make_engine, tokenizer, where):
    """xgrammar raising on one constrained row's drafts: while masking them for verification
    (after the forward) that request fails alone; while proposing them (in schedule) the row
    just drafts nothing and decodes one token a step, its output unchanged. Every other row's
    output is the one a clean run gives."""
    from tests.engine.test_engine import tokens
    from tests.engine.test_speculative import _constrained

    clean = run(make_engine(num_pages=128, num_speculative_tokens=4), _constrained(tokenizer, "c"))
    engine = make_engine(num_pages=128, num_speculative_tokens=4)
    requests = _constrained(tokenizer, "s")
    out = {r.request_id: [] for r in requests}
    for r in requests:
        engine.add_request(r, out[r.request_id].append)
    poison = engine.output.requests["s0"].seqs[0].state.matcher  # noqa: SLF001
    raised = {"n": 0}
    method = "fill_next_token_bitmask" if where == "masks" else "find_jump_forward_tokens"
    real = getattr(poison, method)

    def broken(*args, **kwargs):
        # masks: only the verification's walk (the plain mask filler never sees a drafted row)
        if where == "drafting" or engine.scheduler.running and any(
                s.draft is not None and s.state.matcher is poison for s in engine.scheduler.running):
            raised["n"] += 1
            raise RuntimeError("injected xgrammar fault")
        return real(*args, **kwargs)

    setattr(poison, method, broken)
    while engine.has_work():
        engine.step()
    assert raised["n"] >= 1
    if where == "masks":
        assert isinstance(out["s0"][-1], EngineError) and out["s0"][-1].code == "request_failed"
    else:
        assert tokens(out["s0"]) == tokens(clean["c0"])
    for rid in ("s1", "s2", "slong"):
        assert tokens(out[rid]) == tokens(clean["c" + rid[1:]]), rid
    engine.scheduler.cache.check_integrity()


def _paused_session_with_tier(make_engine, tokenizer):
    """An engine with a host tier whose turn-1 pages were evicted into it by other traffic:
    (engine, turn 1's prompt). Its turn 2 loads them back."""
    from prefixgate.cache.tier import HostTier, entry_slot_bytes
    from prefixgate.engine.kv_tier import KVTier
    from tests.engine.test_engine import greedy
    from tests.engine.test_kv_tier import PROMPT

    engine = make_engine(num_pages=24, watermark=0.0)
    pool = engine.runner.kv_pool
    page_bytes = pool[:, :, 0].numel() * pool.element_size()
    store = HostTier(64 * entry_slot_bytes(page_bytes), entry_slot_bytes(page_bytes))
    engine.attach_tier(KVTier(store, pool, load_timeout_s=30.0))
    paused = chat(tokenizer, PROMPT)
    run(engine, [GenerationRequest(paused, greedy(4), request_id="turn1")])
    others = [chat(tokenizer, f"{i}: {TASKS[i]} " * 14) for i in range(3)]
    run(engine, [GenerationRequest(p, greedy(2), request_id=f"o{i}") for i, p in enumerate(others)])
    engine.tier.flush()
    return engine, paused


def _loads_of_next_step(engine) -> dict:
    """Record each step's scheduler output (``last["out"]``)."""
    last: dict = {}
    real_schedule = engine.scheduler.schedule

    def schedule():
        last["out"] = real_schedule()
        return last["out"]

    engine.scheduler.schedule = schedule
    return last


def test_a_spill_failure_loses_the_spill_only(make_engine, tokenizer):
    """Copying the evicted pages out fails in a step that also installed a tier load: those
    spills are dropped (counted), the load is still written and the returning turn's output
    is the one a plain recompute gives."""
    from tests.engine.test_engine import greedy, tokens

    plain = make_engine(num_pages=24, watermark=0.0)
    from tests.engine.test_kv_tier import PROMPT

    want = tokens(run(plain, [GenerationRequest(chat(tokenizer, PROMPT), greedy(8), request_id="p")])["p"])
    engine, paused = _paused_session_with_tier(make_engine, tokenizer)
    last = _loads_of_next_step(engine)
    real_spill = engine.tier.spill
    injected = {}

    def spill(evicted):
        if last["out"].page_loads and not injected:
            injected["pages"] = len(evicted)
            raise RuntimeError("injected: snapshot of evicted pages failed (e.g. device OOM)")
        return real_spill(evicted)

    engine.tier.spill = spill
    got = run(engine, [GenerationRequest(paused, greedy(8), request_id="turn2")])["turn2"]
    assert injected, "no step both installed a load and spilled (test inconclusive)"
    assert tokens(got) == want and got[-1].usage.cached_tokens > 0
    assert engine.tier.stats().spills_dropped >= injected["pages"]
    engine.scheduler.cache.check_integrity()


def test_a_step_failing_before_its_loads_are_written_leaves_them_unhittable(make_engine, tokenizer):
    """A step that fails after schedule() installed a tier load and before the load was
    written (invariant 8): after recover, none of the load's pages is hittable, and the next
    turn recomputes."""
    from tests.engine.test_engine import greedy

    engine, paused = _paused_session_with_tier(make_engine, tokenizer)
    last = _loads_of_next_step(engine)
    connector = engine.scheduler.connector
    real_move = connector.start_step
    injected = {}

    def move(page_loads):
        if page_loads and not injected:
            injected["loads"] = page_loads
            raise RuntimeError("injected: the step failed before writing its loads")
        return real_move(page_loads)

    connector.start_step = move
    sink = []
    engine.add_request(GenerationRequest(paused, greedy(8), request_id="turn2"), sink.append)
    for _ in range(200):
        if not engine.has_work():
            break
        try:
            engine.step()
        except RuntimeError:
            engine.recover(EngineError("internal error in the engine step"))
    assert injected and last, "no step installed a load (test inconclusive)"
    assert isinstance(sink[-1], EngineError)
    unwritten = [pid for load in injected["loads"] for pid in load.page_ids]
    still_cached = [pid for pid in unwritten if engine.scheduler.cache.pool.pages[pid].block_hash is not None]
    assert still_cached == [], f"pages {still_cached} hold no loaded K/V but are still hittable"
    engine.scheduler.cache.check_integrity()
