"""The engine on the real default model: batching, dedup, preemption, abort, n > 1."""

from __future__ import annotations

import asyncio

import pytest
import torch

from prefixgate.engine.api import (
    ContextLengthError,
    Delta,
    GenerationRequest,
    InvalidRequestError,
    OverloadedError,
    SamplingParams,
)
from prefixgate.engine.async_engine import AsyncEngine
from prefixgate.engine.config import (
    EngineConfig,
    decode_token_budget,
    short_prefill_budget,
    step_token_budget,
)

SYSTEM = (
    "You are a meticulous research assistant in a team of software agents. You can call tools to "
    "search the codebase, read files and run tests. Always explain your reasoning briefly, cite "
    "file paths, and never invent APIs that do not exist. Prefer small, verifiable steps."
)
TASKS = [
    "Find where the HTTP retries are configured.", "Summarise the caching layer in two sentences.",
    "List three risks of the new scheduler.", "What does the tokenizer do with emojis?",
    "Name a test that covers preemption.", "Explain copy-on-write to a new engineer.",
    "Which module owns the block tables?", "Draft a commit message for the kernel fix.",
    "How many pages does a 100-token prompt take?", "Why hash token ids and not text?",
    "Give one reason to pin a system prompt.", "What is a watermark in admission control?",
    "Suggest a benchmark for the router.", "Write a haiku about KV caches.",
    "What happens when Redis is down?", "Describe chunked prefill in one line.",
]


def chat(tokenizer, task: str) -> tuple[int, ...]:
    return tuple(tokenizer.apply_chat_template(
        [{"role": "system", "content": SYSTEM}, {"role": "user", "content": task}]))


def run(engine, requests: list[GenerationRequest]) -> dict[str, list[Delta]]:
    """Submit all, step until all finished; deltas per request id."""
    out: dict[str, list[Delta]] = {r.request_id: [] for r in requests}
    for r in requests:
        engine.add_request(r, out[r.request_id].append)
    while engine.has_work():
        engine.step()
    engine.scheduler.cache.check_integrity()
    return out


def tokens(deltas: list[Delta], choice: int = 0) -> list[int]:
    return [t for d in deltas if d.index == choice for t in d.token_ids]


def ideal_prefill_tokens(prompts) -> int:
    """Tokens an infinite, instantly shared cache would compute: each distinct prefix once."""
    total = 0
    for i, p in enumerate(prompts):
        lcp = 0
        for q in prompts[:i]:
            n = 0
            while n < min(len(p), len(q)) and p[n] == q[n]:
                n += 1
            lcp = max(lcp, n)
        total += len(p) - min(lcp, len(p) - 1)
    return total


def greedy(max_tokens=12, **kw):
    return SamplingParams(max_tokens=max_tokens, temperature=0, **kw)


def test_sixteen_concurrent_equal_one_at_a_time(make_engine, tokenizer):
    engine = make_engine(num_pages=512)
    prompts = [chat(tokenizer, t) for t in TASKS]
    alone = [tokens(run(engine, [GenerationRequest(p, greedy(), request_id=f"s{i}")])[f"s{i}"])
             for i, p in enumerate(prompts)]
    engine.scheduler.cache.reset_cache()
    together = run(engine, [GenerationRequest(p, greedy(), request_id=f"c{i}") for i, p in enumerate(prompts)])
    assert [tokens(together[f"c{i}"]) for i in range(16)] == alone
    last = [d for d in together["c3"] if d.usage][0]
    assert last.usage.prompt_tokens == len(prompts[3]) and last.usage.completion_tokens == 12
    # the shared system prompt's full blocks were hit by all but the first admitted
    shared_blocks = len(chat(tokenizer, "")) // 16 - 1
    hits = sorted(d.usage.cached_tokens for v in together.values() for d in v if d.usage)
    assert hits[-1] >= shared_blocks * 16 and hits.count(0) <= 1
    assert engine.scheduler.cache.stats().pages_used == 0


def test_burst_computes_a_cold_shared_prefix_once(make_engine, tokenizer):
    engine = make_engine(num_pages=512, max_num_batched_tokens=4096)
    prefix = tokenizer.encode(" ".join(["The agent reads the design document carefully."] * 120))[:1000]
    suffixes = [tokenizer.encode(f" Question {i}: what is step {i}?") for i in range(8)]
    requests = [GenerationRequest(tuple(prefix + s), greedy(2), request_id=f"b{i}") for i, s in enumerate(suffixes)]
    run(engine, requests)
    ideal = ideal_prefill_tokens([r.prompt_token_ids for r in requests])  # each prefix once
    assert ideal < 1000 + 8 * 20
    # a follower also recomputes the partial block where it departs from the others (< 16 tokens)
    assert ideal <= engine.prefill_tokens_computed <= ideal + 7 * 15
    assert engine.scheduler.num_dedup_waits >= 7


def test_tiny_page_budget_preempts_without_changing_outputs(make_engine, tokenizer):
    prompts = [chat(tokenizer, t) for t in TASKS[:6]]
    requests = lambda tag: [GenerationRequest(p, greedy(24), request_id=f"{tag}{i}")  # noqa: E731
                            for i, p in enumerate(prompts)]
    # NOTE: no speculation here: drafts make sequences finish in fewer steps, so whether this
    # pool ever preempts would depend on them (tests/engine/test_speculative.py covers both)
    roomy = make_engine(num_pages=512, num_speculative_tokens=0)
    expected = run(roomy, requests("r"))
    pages_per_seq = -(-(max(map(len, prompts)) + 24) // 16)
    tight = make_engine(num_pages=pages_per_seq * 3, watermark=0.0, num_speculative_tokens=0)
    got = run(tight, requests("t"))
    assert tight.scheduler.num_preemptions > 0
    assert [tokens(got[f"t{i}"]) for i in range(6)] == [tokens(expected[f"r{i}"]) for i in range(6)]
    stats = tight.scheduler.cache.stats()
    assert stats.pages_used == 0 and stats.pages_free + stats.pages_cached_free == tight.scheduler.cache.num_pages


def test_abort_mid_decode_frees_pages(make_engine, tokenizer):
    engine = make_engine()
    seen: list[Delta] = []
    engine.add_request(GenerationRequest(chat(tokenizer, TASKS[0]), greedy(64), request_id="ab"), seen.append)
    while len(seen) < 3:
        engine.step()
    assert engine.scheduler.cache.stats().pages_used > 0
    assert engine.abort("ab") and not engine.abort("ab")
    assert engine.scheduler.cache.stats().pages_used == 0 and not engine.has_work()
    engine.scheduler.cache.check_integrity()


def test_n4_forks_share_the_prompt_pages(make_engine, tokenizer):
    engine = make_engine()
    prompt = chat(tokenizer, TASKS[5])
    seen: list[Delta] = []
    req = GenerationRequest(prompt, SamplingParams(max_tokens=8, temperature=0.8, seed=3, n=4), request_id="n4")
    engine.add_request(req, seen.append)
    while not seen:
        engine.step()
    full_prompt_pages = len(prompt) // 16
    table = engine.scheduler.cache.block_table(engine.scheduler.running[0].seq_id)
    assert all(engine.scheduler.cache.ref_count(p) == 4 for p in table[:full_prompt_pages])
    assert engine.scheduler.cache.stats().pages_used < 2 * -(-len(prompt) // 16)
    while engine.has_work():
        engine.step()
    assert {d.index for d in seen} == {0, 1, 2, 3}
    usage = [d.usage for d in seen if d.usage][0]
    assert usage.completion_tokens == 32
    assert engine.scheduler.cache.stats().pages_used == 0


def test_seeded_sampling_is_reproducible(make_engine, tokenizer):
    engine = make_engine()
    prompt = chat(tokenizer, TASKS[13])
    sp = SamplingParams(max_tokens=10, temperature=1.0, top_p=0.9, seed=1234)
    a = run(engine, [GenerationRequest(prompt, sp, request_id="x1")])["x1"]
    b = run(engine, [GenerationRequest(prompt, sp, request_id="x2"),
                     GenerationRequest(chat(tokenizer, TASKS[1]), greedy(), request_id="x3")])["x2"]
    assert tokens(a) == tokens(b)


def test_stop_strings_and_text_stream(make_engine, tokenizer):
    engine = make_engine()
    prompt = chat(tokenizer, "Count from 1 to 20, separated by commas.")
    free = run(engine, [GenerationRequest(prompt, greedy(40), request_id="f")])["f"]
    text = "".join(d.text for d in free)
    assert text == tokenizer.decode(tokens(free))
    stop = text[len(text) // 2: len(text) // 2 + 3]
    cut = run(engine, [GenerationRequest(prompt, greedy(40, stop=(stop,)), request_id="s")])["s"]
    assert "".join(d.text for d in cut) == text[: text.index(stop)]
    assert cut[-1].finish_reason == "stop"


def test_the_final_delta_names_the_stop_string_that_matched(make_engine, tokenizer):
    # the server reads it here (Anthropic's stop_sequence) instead of decoding the output again
    engine = make_engine()
    prompt = chat(tokenizer, "Count from 1 to 20, separated by commas.")
    free = run(engine, [GenerationRequest(prompt, greedy(40), request_id="f")])["f"]
    text = "".join(d.text for d in free)
    early, late = text[len(text) // 3: len(text) // 3 + 3], text[2 * len(text) // 3:][:3]
    absent = "never in a count"
    out = run(engine, [
        GenerationRequest(prompt, greedy(40, stop=(absent, late, early)), request_id="s"),
        GenerationRequest(prompt, greedy(40, stop=(absent,)), request_id="n")])
    first = min((text.find(s), s) for s in (late, early))[1]  # the earliest occurrence
    assert [d.matched_stop for d in out["s"]] == [None] * (len(out["s"]) - 1) + [first]
    assert out["s"][-1].finish_reason == "stop"
    # ended by length (or EOS) with stop strings that never matched: none named
    assert out["n"][-1].finish_reason in ("length", "stop")
    assert all(d.matched_stop is None for d in out["n"])
    assert all(d.matched_stop is None for d in free)


def test_validation_errors_name_the_problem(make_engine):
    engine = make_engine(max_waiting=1)
    with pytest.raises(ContextLengthError, match="8192"):
        engine.add_request(GenerationRequest((1,) * 8000, greedy(500)), lambda d: None)
    with pytest.raises(ContextLengthError, match="KV cache"):
        engine.add_request(GenerationRequest((1,) * 4000, greedy(500)), lambda d: None)
    with pytest.raises(InvalidRequestError, match="vocabulary"):
        engine.add_request(GenerationRequest((1, 10**7)), lambda d: None)
    with pytest.raises(InvalidRequestError, match="empty"):
        engine.add_request(GenerationRequest(()), lambda d: None)
    engine.add_request(GenerationRequest((1, 2, 3), request_id="q1"), lambda d: None)
    with pytest.raises(OverloadedError):
        engine.add_request(GenerationRequest((1, 2, 3), request_id="q2"), lambda d: None)
    engine.abort("q1")


def test_async_engine_streams_and_cancel_frees_pages(make_engine, tokenizer):
    engine = AsyncEngine(make_engine(), model_name="m")
    engine.start_sync()
    prompt = chat(tokenizer, TASKS[2])

    async def main():
        full = [d async for d in engine.generate(GenerationRequest(prompt, greedy(6)))]
        assert full[-1].usage is not None and full[-1].finish_reason == "length"
        stream = engine.generate(GenerationRequest(prompt, greedy(200)))
        first = await stream.__anext__()
        assert first.token_ids
        await stream.aclose()  # the client went away
        return full

    try:
        full = asyncio.run(main())
        assert len([t for d in full for t in d.token_ids]) == 6
        assert engine.wait_idle(30)
        assert engine.cache_stats().pages_used == 0
        stats = engine.engine_stats()
        assert stats.prefill_tokens_computed > 0 and stats.num_running == 0
    finally:
        engine.shutdown_sync()


def test_async_engine_wakes_the_loop_once_per_step(make_engine, tokenizer):
    """Concurrent streams get a step's deltas in one hand-over (one call_soon_threadsafe per
    step, not one per delta), and stream exactly what the sync engine emits, in order."""
    core = make_engine(num_pages=128, num_speculative_tokens=0)
    prompts = [chat(tokenizer, t) for t in TASKS[:4]]
    stop = SamplingParams(max_tokens=10, temperature=0, stop=("\n\n",))
    expected = run(core, [GenerationRequest(p, stop, request_id=f"s{i}") for i, p in enumerate(prompts)])
    engine = AsyncEngine(core, model_name="m")
    wakeups = []

    async def stream(i: int) -> list[Delta]:
        return [d async for d in engine.generate(GenerationRequest(prompts[i], stop, request_id=f"a{i}"))]

    async def main() -> list[list[Delta]]:
        loop = asyncio.get_running_loop()
        call_soon_threadsafe = loop.call_soon_threadsafe

        def counted(*args):
            wakeups.append(core.num_steps)
            return call_soon_threadsafe(*args)

        loop.call_soon_threadsafe = counted
        return await asyncio.gather(*(stream(i) for i in range(4)))

    steps_before = core.num_steps
    engine.start_sync()
    try:
        streamed = asyncio.run(main())
    finally:
        engine.shutdown_sync()
    for i, deltas in enumerate(streamed):
        want = expected[f"s{i}"]
        assert [(d.token_ids, d.text, d.finish_reason) for d in deltas] == \
               [(d.token_ids, d.text, d.finish_reason) for d in want]
        assert deltas[-1].usage is not None
    steps = core.num_steps - steps_before
    assert len(wakeups) == len(set(wakeups)) <= steps  # at most one per step (none for a
    # step whose deltas were all empty is fine too), never one per delta
    assert sum(len(d) for d in streamed) > steps


def test_step_token_budget_defaults_by_device() -> None:
    # when nothing decodes: 512 on CPU (a turn arriving mid-step waits one short step), 2048 on GPU
    assert step_token_budget(EngineConfig(), "cpu") == 512
    assert step_token_budget(EngineConfig(), "cuda") == 2048
    # while a stream decodes: 64 on CPU (the inter-token latency bound), no bound on GPU;
    # a short prefill may run whole up to 192 on CPU, on GPU up to the decode budget
    assert decode_token_budget(EngineConfig(), "cpu") == 64
    assert decode_token_budget(EngineConfig(), "cuda") == 2048
    assert short_prefill_budget(EngineConfig(), "cpu") == 192
    assert short_prefill_budget(EngineConfig(), "cuda") == 2048
    assert short_prefill_budget(EngineConfig(short_prefill_budget=96), "cpu") == 96
    assert short_prefill_budget(EngineConfig(short_prefill_budget=9000), "cpu") == 512
    with pytest.raises(ValueError, match="short_prefill_budget"):
        EngineConfig(short_prefill_budget=0)
    # never below the running-sequence cap, never above the step budget; explicit ones win
    assert step_token_budget(EngineConfig(max_num_seqs=3000), "cpu") == 3000
    # the decode budget has no floor at max_num_seqs (decodes are never skipped for budget)
    assert decode_token_budget(EngineConfig(max_num_seqs=300), "cpu") == 64
    assert decode_token_budget(EngineConfig(decode_step_budget=16), "cpu") == 16
    assert step_token_budget(EngineConfig(max_num_batched_tokens=4096), "cpu") == 4096
    assert decode_token_budget(EngineConfig(max_num_batched_tokens=128, decode_step_budget=512), "cpu") == 128
    assert decode_token_budget(EngineConfig(decode_step_budget=512), "cpu") == 512
    with pytest.raises(ValueError, match="must be >= max_num_seqs"):
        EngineConfig(max_num_batched_tokens=32, max_num_seqs=64)
    with pytest.raises(ValueError, match="decode_step_budget must be >= 1"):
        EngineConfig(decode_step_budget=0)
    with pytest.raises(ValueError, match="admission_order"):
        EngineConfig(admission_order="sjf")


def test_the_scheduler_counts_attention_with_the_models_flop_ratio(make_engine, loaded_model) -> None:
    cfg = loaded_model.config
    # SmolLM2-135M per layer: 3,538,944 projection/MLP weights; attention 4 * 576 FLOPs per
    # context token -> equal at 3,538,944 * 2 / (4 * 576) = 3,072 tokens of context
    assert cfg.attention_context_scale == 3072
    engine = make_engine()
    assert engine.scheduler.context_scale == 3072
    assert engine.scheduler.max_num_batched_tokens == 512
    assert (engine.scheduler.decode_step_budget, engine.scheduler.short_prefill_budget) == (64, 192)


def test_bf16_kv_serves_with_prefix_caching(make_engine, tokenizer):
    """``kv_dtype="bf16"``: the second request of a prompt hits the cache (its last block
    copied on write, as the last prompt token is recomputed into it) and decodes exactly what
    the first decoded over pages it computed itself; speculative drafts write bf16 K/V too."""
    engine = make_engine(kv_dtype="bf16", num_pages=128)
    assert engine.runner.kv_pool.dtype == torch.bfloat16 and engine.runner.native_cpu_kernels
    prompt = chat(tokenizer, TASKS[5])
    prompt = prompt[: len(prompt) // 16 * 16]  # whole blocks: a full hit, then copy-on-write
    first = run(engine, [GenerationRequest(prompt, greedy(24), request_id="a")])["a"]
    second = run(engine, [GenerationRequest(prompt, greedy(24), request_id="b")])["b"]
    assert tokens(second) == tokens(first) and len(tokens(first)) == 24
    usage = [d.usage for d in second if d.usage][0]
    assert usage.cached_tokens == len(prompt) - 1  # a full hit stops one token short
    assert engine.scheduler.cache.stats().cow_copies == 1  # ... and writes it into a copy of the page
    assert engine.spec_stats()["spec_drafts"] > 0
    engine.scheduler.cache.check_integrity()


def test_requests_compiling_their_grammar_count_against_the_waiting_queue(make_engine):
    """A burst of cold schemas must not all pass the queue-full check while they compile."""
    import threading

    from prefixgate.engine.api import GrammarSpec

    engine = AsyncEngine(make_engine(max_waiting=1), model_name="m")
    release = threading.Event()

    def slow_compile(spec, tenant):  # stands in for a cold compile; then the spec is refused
        release.wait(30)
        raise InvalidRequestError("refused after compiling", param="response_format")

    engine.core.grammars.compile = slow_compile
    engine.start_sync()
    spec = GrammarSpec("json_schema", '{"type": "object"}')

    async def first_token(request_id: str) -> None:
        async for _ in engine.generate(GenerationRequest((1, 2, 3), grammar=spec,
                                                         request_id=request_id)):
            return

    async def main():
        first = asyncio.ensure_future(first_token("a"))
        await asyncio.sleep(0.05)  # "a" is compiling now
        with pytest.raises(OverloadedError):
            await first_token("b")
        release.set()
        with pytest.raises(InvalidRequestError, match="refused after compiling"):
            await first

    try:
        asyncio.run(main())
        # the refused compile gave its place back: the queue is empty again
        assert engine._num_queued == 0
    finally:
        release.set()
        engine.shutdown_sync()
