"""Structured outputs and tool calling: constrained decode speed, grammar compile cost, and the
prefix hits of a tool-calling agent loop over HTTP, on the default model, in one run.

Workload (deterministic, seed 0; defaults in brackets, --quick in braces):
  * decode: one engine (SmolLM2-135M-Instruct, CPU, 16-token pages, prefix caching on) and 16
    distinct short chat prompts (~40 tokens: "give a long JSON list of integers: X"). Batch 1
    runs the first prompt, batch 16 all of them; every row is greedy with max_tokens =
    --decode-tokens [64] {32}. Constrained rows carry the json_schema ``{"items": array of
    integers, minItems 64}``: at least two tokens per item, so no row can finish inside the
    window; free rows run the same prompts with ignore_eos. Every row is checked to end with
    finish_reason "length" after exactly max_tokens tokens (``*_window_tokens_b*`` = tokens
    actually generated in the window). Timed: the decode window only, from the step after
    which every row has its first token (prefill done) to the end. Constrained and free runs
    alternate back to back (the order flips each repeat), one warm-up pair, then --repeats
    [5] {2} pairs. Reported per batch: median tokens/s of each kind; the median step time of
    each kind over all its windows (``*_step_ms_b*``); ``constrained_over_free_b{1,16}`` = the
    median over pairs of (constrained tokens/s / free tokens/s), a load burst on the shared
    machine hitting both runs of a pair (goal: >= 0.9 at b16); ``*_by_step`` = the same ratio
    from the median step times.
    What a constrained b16 step adds, each part timed alone (median of 50, microseconds; the
    matchers mid-array): the bitmask fill (``mask_fill_us_b16``; in the engine it overlaps
    the forward), one bitmask row per sampled row (``row_bitmask_us_b16``), the sampler with
    vs without the bitmask (``sample_us_b16_masked`` / ``_free``; ``apply_bitmask_us_b16`` is
    its native mask kernel alone), 16 matchers accepting a token (``accept_us_b16``).
    ``grammar_critical_us_b16`` = rows + (masked - free sampling) + accept, the serial part;
    ``constrained_over_free_b16_predicted`` = free step / (free step + that).
  * compile: the 14 tool-parameter schemas of agents.texts.TOOLS as json_schema specs, made
    distinct per repeat by a ``title`` (every first compile is a cache miss: checked on the
    compiler's miss counter). Cold = the first compile of a spec; warm = an equal spec again
    (the engine's LRU); medians over 14 schemas x --compile-repeats [3] {1} (warm: 3 lookups
    each). The chat path of a tool list: a ChatCompletionRequest with the 14 tools (bounded
    as in the tool loop below), tool_choice "required", then ``output_grammar()`` (schema checks, EBNF per schema, the
    structural tag) + ``engine.grammars.compile(spec)``. ``tool_grammar_ms_warm`` = that for
    the same tool list again (what every request of a swarm pays; parsing the request is
    outside the timer: ``tool_request_parse_ms``); ``tool_grammar_ms_cold`` = tool names
    changed per repeat and the EBNF cache cleared. Goal: compile_ms_warm < 1 ms.
  * tool loop: a live gateway (uvicorn in-process over the same engine, one tenant, a pool of
    --num-pages [2048] pages, so nothing is evicted: ``tool_loop_evictions`` reports it) and
    --agents [8] {4} agents over httpx, all started at once (asyncio), each running --turns
    [4] {2} turns. Shared: a 2,437-token prefix (system prompt of role, rules and policies
    from agents.texts, ~1.1k tokens, plus the 14 tools, which the gateway renders into it).
    The tools' schemas get size bounds (maxLength 40 per free string, its ``format``
    dropped as xgrammar ignores maxLength beside one; maxItems 4, maxProperties 3, integer
    maximum 100,000): unbounded, greedy decoding runs on inside a string
    ("https://www.x.com/v2/v2/v2/...") until max_tokens cuts the call. Per agent: its own
    task message (~60 tokens). Each turn: a non-streamed chat completion with the tools,
    tool_choice "required", parallel_tool_calls false, temperature 0, max_tokens
    --tool-max-tokens [128], logprobs on (the generated tokens, see below); the agent appends
    the assistant message with its tool_calls and a ``role: "tool"`` result (~60 tokens,
    agents.texts.tool_result) and sends the next turn (a call cut by max_tokens ends the
    agent: ``tool_loop_cut_calls``). Recorded per request: usage cached_tokens and, after
    the run, its prompt token ids from POST /tokenize with the same messages and tools
    (checked equal in count to usage.prompt_tokens).
    Ideal = agents.ideal.ideal_hits over the requests in client send order (everything sent
    earlier; an agent's previous turn with its generated tokens as they reappear in the next
    prompt; capped one token short; whole pages). ``tool_loop_achieved_over_ideal`` =
    sum(cached_tokens) / sum(ideal) (goal: >= 0.98). That ideal takes the next prompt's
    tokens for the previous turn's generated ones; but the next prompt re-tokenizes the call's
    text, and the model often spelled it with other tokens ('{', '"' for '{"'; 'f', 'et',
    'ch' for 'fetch'), whose KV no cache can serve. ``*_exact`` uses only the generated
    tokens the next prompt repeats token for token (compared by their logprobs text);
    ``tool_loop_call_tokens_resent`` / ``_repeated`` count them. Per request, the turn-1
    figures depend on arrival order (the ideal credits the first request SENT with the
    shared prefix, the engine the first ADMITTED); the sums do not.

Threads: torch's own choice unless --threads. On a busy 2-core machine, two torch threads
stall at every parallel region whenever another process holds a core (b16 steps 5-8x slower,
window ratios anywhere in 0.1-1.2); with --threads 1 the ratios held within 0.93-1.16 at a
load average of 3.6 (the full run took 5.5 min there; idle it should take ~2).

    python -m benchmarks.structured --json out/structured.json
    python -m benchmarks.structured --threads 1 --json out/structured.json   # a busy machine
    python -m benchmarks.structured --quick                                  # smoke run
    python -m benchmarks.structured --profile      # + cProfile of a constrained b16 run
"""

from __future__ import annotations

import asyncio
import cProfile
import io
import json
import os
import pstats
import random
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import httpx
import torch

from benchmarks.common import base_parser, free_port, print_table, write_json
from prefixgate.agents import texts
from prefixgate.agents.ideal import SentPrompt, ideal_hits
from prefixgate.engine.api import (
    Delta,
    EngineError,
    GenerationRequest,
    GrammarSpec,
    SamplingParams,
)
from prefixgate.engine.async_engine import AsyncEngine
from prefixgate.engine.build import create_llm_engine
from prefixgate.engine.config import EngineConfig
from prefixgate.engine.engine_core import LLMEngine
from prefixgate.engine.grammar import new_matcher
from prefixgate.engine.loader import load_model
from prefixgate.engine.sampler import SampleRow, sample
from prefixgate.engine.step_masks import row_bitmask
from prefixgate.gateway.server import ServerSettings, create_app
from prefixgate.gateway.server.launch import GatewayServer, ServersThread, uvicorn_config
from prefixgate.gateway.server.openai.schemas import ChatCompletionRequest
from prefixgate.kernels.token_bitmask import apply_token_bitmask

PAGE_SIZE = 16
BATCHES = (1, 16)
DECODE_SCHEMA = {
    "type": "object",
    "properties": {"items": {"type": "array", "items": {"type": "integer"}, "minItems": 64}},
    "required": ["items"],
}
TOPICS = (
    "prime numbers", "years of famous inventions", "football scores", "room numbers in a hotel",
    "temperatures in July", "page numbers of a book index", "bus lines in a city",
    "ages of a family", "square numbers", "stock prices", "heights of mountains in metres",
    "distances of marathons", "zip codes", "Fibonacci numbers", "phone extensions",
    "lottery draws",
)
SYSTEM_TOKENS, TASK_TOKENS, RESULT_TOKENS = 1100, 60, 60  # approx budgets; the tools add ~1.3k


# ------------------------------------------------------------------------------ 1. decode


@dataclass(slots=True)
class DecodeRun:
    tokens_per_s: float
    window_tokens: int  # generated inside the timed window (after every row's first token)
    window_s: float
    step_s: list[float]  # each step of the window
    tokens_per_row: list[int]
    finish_reasons: list[str | None]


def decode_prompts(tokenizer) -> list[tuple[int, ...]]:
    return [tuple(tokenizer.apply_chat_template([
        {"role": "system", "content": "You answer with JSON only."},
        {"role": "user", "content": f"Give a long JSON list of integers: {topic}."}]))
        for topic in TOPICS]


def decode_window(engine: LLMEngine, prompts: list[tuple[int, ...]], max_tokens: int,
                  grammar: GrammarSpec | None, tag: str) -> DecodeRun:
    """Run ``prompts`` as one batch to the end; time the steps after every row's first token."""
    outputs: dict[str, list[Delta]] = {}
    for i, prompt in enumerate(prompts):
        rid = f"{tag}-{i}"
        outputs[rid] = []
        sampling = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=grammar is None)
        engine.add_request(GenerationRequest(prompt, sampling, request_id=rid, grammar=grammar),
                           outputs[rid].append)

    def generated() -> int:
        return sum(len(d.token_ids) for deltas in outputs.values() for d in deltas
                   if isinstance(d, Delta))

    while engine.has_work() and not all(outputs.values()):
        engine.step()
    before = generated()
    start = last = time.perf_counter()
    step_s = []
    while engine.has_work():
        engine.step()
        now = time.perf_counter()
        step_s.append(now - last)
        last = now
    window_s = last - start
    errors = [d for deltas in outputs.values() for d in deltas if isinstance(d, EngineError)]
    if errors:
        raise RuntimeError(f"{tag}: a row failed: {errors[0]!r}")
    window_tokens = generated() - before
    return DecodeRun(window_tokens / window_s, window_tokens, window_s, step_s,
                     [sum(len(d.token_ids) for d in deltas) for deltas in outputs.values()],
                     [deltas[-1].finish_reason for deltas in outputs.values()])


def bench_decode(engine: LLMEngine, prompts: list[tuple[int, ...]], max_tokens: int,
                 repeats: int) -> dict[str, Any]:
    spec = GrammarSpec("json_schema", json.dumps(DECODE_SCHEMA))
    results: dict[str, Any] = {}
    for batch in BATCHES:
        rows = prompts[:batch]
        samples: dict[str, list[DecodeRun]] = {"constrained": [], "free": []}
        kinds = {"constrained": spec, "free": None}
        for rep in range(repeats + 1):  # rep 0 = warm-up
            order = ("constrained", "free") if rep % 2 == 0 else ("free", "constrained")
            for kind in order:
                run = decode_window(engine, rows, max_tokens, kinds[kind], f"b{batch}-{kind}-{rep}")
                bad = [(n, f) for n, f in zip(run.tokens_per_row, run.finish_reasons, strict=True)
                       if n != max_tokens or f != "length"]
                if bad:
                    raise RuntimeError(f"b{batch} {kind}: rows ended early (tokens, finish): {bad}")
                if rep > 0:
                    samples[kind].append(run)
        for kind, runs in samples.items():
            results[f"{kind}_tokens_per_s_b{batch}"] = statistics.median(r.tokens_per_s for r in runs)
            results[f"{kind}_window_tokens_b{batch}"] = runs[0].window_tokens
            # the median step of all windows: robust to a load burst inside one window
            results[f"{kind}_step_ms_b{batch}"] = 1000 * statistics.median(
                t for r in runs for t in r.step_s)
        # paired: each repeat's two runs are back to back, so a load burst hits both
        pairs = [c.tokens_per_s / f.tokens_per_s
                 for c, f in zip(samples["constrained"], samples["free"], strict=True)]
        results[f"constrained_over_free_b{batch}"] = statistics.median(pairs)
        results[f"constrained_over_free_b{batch}_pairs"] = pairs
        results[f"constrained_over_free_b{batch}_by_step"] = (
            results[f"free_step_ms_b{batch}"] / results[f"constrained_step_ms_b{batch}"])
    results["tokens_per_row"] = max_tokens
    return results


def grammar_step_costs(engine: LLMEngine, free_step_ms: float, batch: int = 16,
                       repeats: int = 50) -> dict[str, float]:
    """What a constrained batch adds to a step, each part timed alone (medians, microseconds).

    The matchers stand mid-array (``{"items": [1, 2, ``), the state a decode window is in.
    Off the critical path: the bitmask fill (it runs during the forward). On it: one bitmask
    row per sampled row (``step_masks.row_bitmask``), the sampler's extra work with a bitmask (apply +
    the dead-end check), and each matcher accepting its token.
    """
    compiled = engine.grammars.compile(GrammarSpec("json_schema", json.dumps(DECODE_SCHEMA)))
    tokenizer = engine.tokenizer
    opening = tokenizer.encode('{"items": [1, 2, ', add_special_tokens=False)
    matchers = [new_matcher(compiled) for _ in range(batch)]
    for matcher in matchers:
        if not all(matcher.accept_token(t) for t in opening):
            raise RuntimeError("the decode schema rejects its own opening")
    next_token = tokenizer.encode("3", add_special_tokens=False)[0]
    masker = engine.grammars.masker()  # the engine's own masker, as a step uses it
    vocab = engine.runner.vocab_size
    logits = torch.randn(batch, vocab)
    prompt = list(range(100, 140))
    rows = [SampleRow(SamplingParams(max_tokens=64, temperature=0), prompt, len(prompt), None)
            for _ in range(batch)]
    times: dict[str, list[float]] = {k: [] for k in
                                     ("fill", "rows", "apply", "sample_free", "sample_mask", "accept")}

    def timed(key: str, fn: Callable[[], Any]) -> Any:
        start = time.perf_counter()
        out = fn()
        times[key].append(time.perf_counter() - start)
        return out

    for _ in range(repeats):
        bitmask = timed("fill", lambda: masker.fill_now(matchers))
        row_mask = timed("rows", lambda bitmask=bitmask: row_bitmask(
            bitmask, list(range(batch)), logits.device))
        work = logits.clone()
        timed("apply", lambda work=work, row_mask=row_mask: apply_token_bitmask(work, row_mask))
        work = logits.clone()
        timed("sample_free", lambda work=work: sample(work, rows))
        work = logits.clone()
        timed("sample_mask", lambda work=work, row_mask=row_mask: sample(work, rows, row_mask))
        timed("accept", lambda: [(m.accept_token(next_token), m.is_terminated()) for m in matchers])
        for matcher in matchers:
            matcher.rollback(1)
    us = {k: 1e6 * statistics.median(v) for k, v in times.items()}
    critical_us = us["rows"] + max(0.0, us["sample_mask"] - us["sample_free"]) + us["accept"]
    return {
        f"mask_fill_us_b{batch}": us["fill"],
        f"row_bitmask_us_b{batch}": us["rows"],
        f"apply_bitmask_us_b{batch}": us["apply"],
        f"sample_us_b{batch}_free": us["sample_free"],
        f"sample_us_b{batch}_masked": us["sample_mask"],
        f"accept_us_b{batch}": us["accept"],
        f"grammar_critical_us_b{batch}": critical_us,
        # the ratio these parts alone predict, against the measured free step
        f"constrained_over_free_b{batch}_predicted": free_step_ms / (free_step_ms + critical_us / 1000),
    }


def profile_constrained(engine: LLMEngine, prompts: list[tuple[int, ...]], max_tokens: int) -> str:
    """cProfile of one constrained batch-16 run (top functions by own time)."""
    spec = GrammarSpec("json_schema", json.dumps(DECODE_SCHEMA))
    profiler = cProfile.Profile()
    profiler.enable()
    decode_window(engine, prompts, max_tokens, spec, "profile")
    profiler.disable()
    out = io.StringIO()
    pstats.Stats(profiler, stream=out).sort_stats("tottime").print_stats(18)
    return out.getvalue()


# ------------------------------------------------------------------------------ 2. compile


def tool_list(suffix: str = "", *, bounded: bool = False) -> list[dict[str, Any]]:
    """The 14 tools of agents.texts in the OpenAI ``tools`` format (names + ``suffix``).

    ``bounded``: every string, integer, array and map gets a size bound (``_bounded``).
    """
    tools = [texts.tool_schema(*spec) for spec in texts.TOOLS]
    for tool in tools:
        tool["function"]["name"] += suffix
        if bounded:
            tool["function"]["parameters"] = _bounded(tool["function"]["parameters"])
    return tools


def _bounded(node: Any) -> Any:
    """A schema whose every value has a bounded size: greedy decoding of a 135M model runs on
    inside an unbounded string ("https://www.x.com/v2/v2/v2/...") until max_tokens, which cuts
    the call. NOTE: xgrammar ignores maxLength next to a ``format``, so the format goes."""
    if not isinstance(node, dict):
        return node
    node = {k: _bounded(v) for k, v in node.items()}
    kind = node.get("type")
    if kind == "string" and not {"enum", "pattern"} & node.keys():
        node.pop("format", None)
        node.setdefault("maxLength", 40)
    elif kind == "integer":
        node.setdefault("maximum", 100_000)
    elif kind == "array":
        node.setdefault("maxItems", 4)
    elif kind == "object" and isinstance(node.get("additionalProperties"), dict):
        node.setdefault("maxProperties", 3)
    return node


def _ms(fn: Callable[[], object]) -> float:
    start = time.perf_counter()
    fn()
    return 1000 * (time.perf_counter() - start)


def bench_compile(engine: LLMEngine, repeats: int) -> dict[str, Any]:
    compiler = engine.grammars.compiler  # built here: its tokenizer table is not a compile cost
    cold, warm = [], []
    for rep in range(repeats):
        for name, _, properties, required in texts.TOOLS:
            schema = {"title": f"{name}-{rep}", "type": "object", "properties": properties,
                      "required": required}
            text = json.dumps(schema)
            misses = compiler.stats.misses
            cold.append(_ms(lambda text=text: engine.grammars.compile(GrammarSpec("json_schema", text))))
            if compiler.stats.misses != misses + 1:
                raise RuntimeError(f"{name}: the 'cold' compile was a cache hit")
            for _ in range(3):
                spec = GrammarSpec("json_schema", json.dumps(schema))  # equal, not the same object
                warm.append(_ms(lambda spec=spec: engine.grammars.compile(spec)))

    def chat_body(tools: list[dict[str, Any]]) -> dict[str, Any]:
        return {"model": "m", "messages": [{"role": "user", "content": "hi"}], "tools": tools,
                "tool_choice": "required", "parallel_tool_calls": False}

    def full_path(request: ChatCompletionRequest) -> None:
        spec = request.output_grammar()
        assert spec is not None
        engine.grammars.compile(spec)

    tool_cold = []
    for rep in range(max(3, repeats)):
        # cold: new tool names each round, so neither the converted schema nor the compile is cached
        request = ChatCompletionRequest.model_validate(chat_body(tool_list(f"_cold{rep}", bounded=True)))
        misses = compiler.stats.misses
        tool_cold.append(_ms(lambda request=request: full_path(request)))
        if compiler.stats.misses != misses + 1:
            raise RuntimeError("the cold tool grammar was a cache hit")
    body = chat_body(tool_list(bounded=True))
    full_path(ChatCompletionRequest.model_validate(body))  # the swarm's first request
    tool_warm, parse = [], []
    for _ in range(30):
        start = time.perf_counter()
        request = ChatCompletionRequest.model_validate(body)
        parse.append(1000 * (time.perf_counter() - start))
        tool_warm.append(_ms(lambda request=request: full_path(request)))
    return {
        "compile_ms_cold": statistics.median(cold),
        "compile_ms_warm": statistics.median(warm),
        "compile_schemas": len(cold),
        "tool_grammar_ms_cold": statistics.median(tool_cold),
        "tool_grammar_ms_warm": statistics.median(tool_warm),
        "tool_request_parse_ms": statistics.median(parse),
        "tool_grammar_tools": len(body["tools"]),
    }


# ------------------------------------------------------------------------------ 3. tool loop


@dataclass(slots=True)
class Sent:
    agent: int
    turn: int
    messages: list[dict[str, Any]]
    previous: int | None  # index (in send order) of this agent's previous request
    response: dict[str, Any] = field(default_factory=dict)

    @property
    def finish_reason(self) -> str | None:
        return self.response["choices"][0]["finish_reason"] if self.response else None

    @property
    def generated_texts(self) -> list[str]:
        """The text of each generated token, from the response's logprobs."""
        return [entry["token"] for entry in self.response["choices"][0]["logprobs"]["content"]]



def agent_openings(num_agents: int, seed: int = 0) -> tuple[str, list[str]]:
    """The shared system prompt (the gateway appends the tools to it) and one task per agent."""
    rng = random.Random(seed)
    instructions, _, policies = texts.system_prompt(rng, SYSTEM_TOKENS)
    system = texts.render_system(instructions, [], policies)
    return system, [texts.task(rng, TASK_TOKENS) for _ in range(num_agents)]


async def run_agents(base_url: str, model: str, num_agents: int, turns: int,
                     max_tokens: int) -> list[Sent]:
    system, tasks = agent_openings(num_agents)
    tools = tool_list(bounded=True)
    sent: list[Sent] = []
    results = {i: random.Random(1000 + i) for i in range(num_agents)}  # each agent's tool outputs

    async def agent(client: httpx.AsyncClient, index: int) -> None:
        messages = [{"role": "system", "content": system}, {"role": "user", "content": tasks[index]}]
        previous = None
        for turn in range(turns):
            record = Sent(index, turn, [dict(m) for m in messages], previous)
            previous = len(sent)
            sent.append(record)  # send order = the order requests leave the client
            response = await client.post("/v1/chat/completions", json={
                "model": model, "messages": messages, "tools": tools, "tool_choice": "required",
                "parallel_tool_calls": False, "temperature": 0, "max_tokens": max_tokens,
                # logprobs: the generated tokens, to see which of them the next prompt repeats
                "logprobs": True, "user": f"agent-{index}"})
            if response.status_code != 200:
                raise RuntimeError(f"agent {index} turn {turn}: {response.status_code} {response.text}")
            record.response = response.json()
            message = record.response["choices"][0]["message"]
            calls = message.get("tool_calls") or []
            if record.finish_reason != "tool_calls" or not calls:
                return  # cut by max_tokens inside a call: no JSON arguments to send back
            messages.append({"role": "assistant", "content": message.get("content"),
                             "tool_calls": calls})
            for call in calls:
                messages.append({"role": "tool", "tool_call_id": call["id"], "content":
                                 texts.tool_result(results[index], call["function"]["name"],
                                                   RESULT_TOKENS)})

    async with httpx.AsyncClient(base_url=base_url, timeout=600) as client:
        await asyncio.gather(*(agent(client, i) for i in range(num_agents)))
    return sent


async def tokenize_all(base_url: str, sent: list[Sent]) -> list[list[int]]:
    tools = tool_list(bounded=True)
    async with httpx.AsyncClient(base_url=base_url, timeout=120) as client:
        out = []
        for record in sent:
            response = await client.post("/tokenize", json={
                "messages": record.messages, "tools": tools, "tool_choice": "required"})
            response.raise_for_status()
            out.append(response.json()["tokens"])
    return out


def bench_tool_loop(core: LLMEngine, info: dict[str, Any], num_agents: int, turns: int,
                    max_tokens: int) -> dict[str, Any]:
    engine = AsyncEngine(core, model_name=info["model_name"], device=info["device"],
                         kernel_backend=info["kernel_backend"])
    core.scheduler.cache.reset_cache()  # the decode runs' pages: start the loop from an empty cache
    port = free_port()
    settings = ServerSettings(host="127.0.0.1", port=port, log_level="warning")
    app = create_app(engine, settings, manage_engine=False)
    server = GatewayServer(uvicorn_config(app, settings), engine, settings)
    thread = ServersThread([server], [engine], name="structured-gateway")
    thread.start_and_wait()
    base_url = f"http://127.0.0.1:{port}"
    try:
        evictions_before = engine.cache_stats().evictions
        start = time.perf_counter()
        sent = asyncio.run(run_agents(base_url, info["model_name"], num_agents, turns, max_tokens))
        wall = time.perf_counter() - start
        prompts = asyncio.run(tokenize_all(base_url, sent))
        engine.wait_idle(60)
        stats = engine.cache_stats()
    finally:
        thread.stop()
    usages = [r.response["usage"] for r in sent]
    mismatched = [i for i, (p, u) in enumerate(zip(prompts, usages, strict=True))
                  if len(p) != u["prompt_tokens"]]
    if mismatched:
        raise RuntimeError(f"/tokenize disagrees with usage.prompt_tokens for requests {mismatched}")
    reuse = regenerated_prefixes(core.tokenizer, sent, prompts)
    ideal = ideal_hits([SentPrompt(p, u["completion_tokens"], r.previous)
                        for p, u, r in zip(prompts, usages, sent, strict=True)], PAGE_SIZE).blocks
    # the same ideal, but an agent's previous turn brings only the generated tokens its next
    # prompt repeats token for token (what any cache of those tokens' KV could serve)
    exact = ideal_hits([SentPrompt(p, reuse.matched[i] + 1, r.previous)
                        for i, (p, r) in enumerate(zip(prompts, sent, strict=True))], PAGE_SIZE).blocks
    achieved = [u["prompt_tokens_details"]["cached_tokens"] for u in usages]
    shortfalls = [{"agent": r.agent, "turn": r.turn, "prompt_tokens": len(p), "cached": a,
                   "ideal": i, "ideal_exact": e}
                  for r, p, a, i, e in zip(sent, prompts, achieved, ideal, exact, strict=True)
                  if a < i]
    shared = min(_common_prefix(prompts[0], p) for p in prompts[1:]) if len(prompts) > 1 else 0
    return {
        "tool_loop_achieved_over_ideal": sum(achieved) / sum(ideal) if sum(ideal) else 0.0,
        "tool_loop_achieved_over_ideal_exact": sum(achieved) / sum(exact) if sum(exact) else 0.0,
        "tool_loop_cached_tokens": sum(achieved),
        "tool_loop_ideal_tokens": sum(ideal),
        "tool_loop_ideal_exact_tokens": sum(exact),
        "tool_loop_prompt_tokens": sum(u["prompt_tokens"] for u in usages),
        "tool_loop_completion_tokens": sum(u["completion_tokens"] for u in usages),
        "tool_loop_call_tokens_resent": reuse.resent,
        "tool_loop_call_tokens_repeated": sum(reuse.matched),
        "tool_loop_requests": len(sent),
        "tool_loop_agents": num_agents,
        "tool_loop_turns": turns,
        "tool_loop_shared_prefix_tokens": shared,
        "tool_loop_finish_tool_calls": sum(r.finish_reason == "tool_calls" for r in sent),
        "tool_loop_cut_calls": sum(r.finish_reason == "length" for r in sent),
        "tool_loop_wall_s": wall,
        "tool_loop_evictions": stats.evictions - evictions_before,
        "tool_loop_pages_used_after": stats.pages_used,
        "tool_loop_shortfalls": shortfalls,
        "tool_loop_retokenized_examples": reuse.examples,
    }


class Regenerated(NamedTuple):
    matched: list[int]  # per request: leading generated tokens (less the last) its next prompt repeats
    resent: int  # generated tokens (less each turn's last) that a next prompt re-sent as text
    examples: list[dict[str, Any]]  # the first divergences: generated vs re-tokenized


def regenerated_prefixes(tokenizer: Any, sent: list[Sent], prompts: list[list[int]]) -> Regenerated:
    """How many of each turn's generated tokens the agent's next prompt holds token for token.

    The next prompt re-renders the call as text and tokenizes it again; where the model spelled
    the call with other tokens than the tokenizer would, the KV of those tokens cannot serve
    the next turn. Tokens are compared by their text (what logprobs report).
    """
    matched = [0] * len(sent)
    resent, examples = 0, []
    for i, record in enumerate(sent):
        if record.previous is None:
            continue
        j = record.previous
        before, generated = prompts[j], sent[j].generated_texts[:-1]  # the last one has no KV
        if prompts[i][: len(before)] != before:
            continue  # the conversation did not extend (never expected here)
        resent += len(generated)
        following = [tokenizer.decode([t], skip_special_tokens=False)
                     for t in prompts[i][len(before): len(before) + len(generated)]]
        n = 0
        while n < min(len(generated), len(following)) and generated[n] == following[n]:
            n += 1
        matched[j] = n
        if n < len(generated) and len(examples) < 3:
            examples.append({"agent": record.agent, "turn": record.turn - 1, "at": n,
                             "generated": generated[max(0, n - 2): n + 6],
                             "retokenized": following[max(0, n - 2): n + 6]})
    return Regenerated(matched, resent, examples)


def _common_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


# ------------------------------------------------------------------------------ main


def main() -> None:
    parser = base_parser(__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="a smaller smoke run")
    parser.add_argument("--decode-tokens", type=int, default=None, help="tokens per row [64]")
    parser.add_argument("--repeats", type=int, default=None, help="decode samples per kind [5]")
    parser.add_argument("--compile-repeats", type=int, default=None, help="[3]")
    parser.add_argument("--agents", type=int, default=None, help="tool-loop agents [8]")
    parser.add_argument("--turns", type=int, default=None, help="tool turns per agent [4]")
    parser.add_argument("--tool-max-tokens", type=int, default=128)
    parser.add_argument("--num-pages", type=int, default=2048)
    parser.add_argument("--profile", action="store_true", help="cProfile a constrained b16 run")
    parser.add_argument("--threads", type=int, default=None,
                        help="torch.set_num_threads (default: torch's own choice)")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    quick = args.quick
    decode_tokens = args.decode_tokens or (32 if quick else 64)
    repeats = args.repeats or (2 if quick else 5)
    compile_repeats = args.compile_repeats or (1 if quick else 3)
    agents = args.agents or (4 if quick else 8)
    turns = args.turns or (2 if quick else 4)

    started = time.perf_counter()
    loaded = load_model(None)
    core, info = create_llm_engine(
        EngineConfig(num_pages=args.num_pages, page_size=PAGE_SIZE, device="cpu"), loaded=loaded)
    results: dict[str, Any] = {
        "workload": (f"decode b1/b16 x {decode_tokens} tokens, {repeats} repeats; compile 14 "
                     f"schemas x {compile_repeats}; tool loop {agents} agents x {turns} turns"),
        "quick": quick,
        "device": info["device"],
        "torch_threads": torch.get_num_threads(),
        "num_pages": info["num_pages"],
        "loadavg_1min_start": os.getloadavg()[0],  # a shared machine: how busy it was
        "model_load_s": time.perf_counter() - started,
    }
    start = time.perf_counter()
    core.grammars.compiler  # noqa: B018 - the compiler's tokenizer table, built once per engine
    results["compiler_init_ms"] = 1000 * (time.perf_counter() - start)
    prompts = decode_prompts(loaded.tokenizer)
    stage_start: dict[str, float] = {}

    def stage(name: str) -> None:
        stage_start[name] = time.perf_counter()
        print(f"[{stage_start[name] - started:6.1f} s] {name} ...", flush=True)

    stage("decode")
    results.update(bench_decode(core, prompts, decode_tokens, repeats))
    core.scheduler.cache.check_integrity()
    results.update(grammar_step_costs(core, results["free_step_ms_b16"]))
    profile = profile_constrained(core, prompts, decode_tokens) if args.profile else None
    stage("compile")
    results.update(bench_compile(core, compile_repeats))
    stage("tool loop")
    results.update(bench_tool_loop(core, info, agents, turns, args.tool_max_tokens))
    core.scheduler.cache.check_integrity()  # the engine thread has stopped
    stage_start["end"] = time.perf_counter()
    names = list(stage_start)
    for name, following in zip(names, names[1:], strict=False):
        results[f"stage_s_{name.replace(' ', '_')}"] = stage_start[following] - stage_start[name]
    results["bench_wall_s"] = stage_start["end"] - started
    results["loadavg_1min_end"] = os.getloadavg()[0]

    print_table("structured outputs (benchmarks.structured)",
                [(k, v) for k, v in results.items() if not isinstance(v, list | dict)])
    for key in ("tool_loop_shortfalls", "tool_loop_retokenized_examples"):
        if results[key]:
            print(f"\n{key}:")
            for row in results[key]:
                print("  ", row)
    if profile is not None:
        print("\ncProfile, one constrained b16 run (prefill + decode):\n" + profile)
    write_json(args.json, results)


if __name__ == "__main__":
    main()
