"""Agent sessions across tool pauses: LRU vs tool-call retention vs retention + a host KV tier,
over live HTTP against `prefixgate serve` subprocesses, one server after the other, in one run
(issue #16, section 4).

Workload (deterministic given --seed [0]; defaults in brackets, --quick in braces):
  * --agents [32] {8} agents x --turns [6] {3} turns, over the OpenAI chat API with streaming
    (httpx async; TTFT = send -> first delta carrying content or tool-call text, the role-only
    opening chunk does not count).
  * Shared by every agent: one system prompt of about --system-tokens [1000] {200} approximate
    tokens (role, rules and policies from agents.texts) plus the first --tools [14] {3} tool
    schemas of agents.texts.TOOLS with their required parameters only (the gateway renders
    them into the prompt), each schema bounded (strings maxLength 12, integers <= 1000,
    arrays <= 2 items, maps <= 2 keys), so a greedy 135M model writes a short call instead of
    running on to max_tokens.
  * Per agent: its own task message (--task-tokens [60] {40}); each turn is a request with
    tool_choice "required", parallel_tool_calls false, temperature 0, max_tokens
    --max-tokens [96] {96}; the response ends in `finish_reason: "tool_calls"` (a call cut by
    max_tokens is counted in ``cut_calls``; its partial arguments are sent back as they came).
    The agent appends the assistant message with its tool_calls and a ``role: "tool"`` result
    of about --result-tokens [200] {200} tokens (agents.texts.tool_result, seeded per agent and
    turn), so the conversation grows by ~result + call tokens a turn, then sends the next turn.
  * Tool pauses: after turns 1..T-1 the agent sleeps
        pause = clip(LogNormal(mu=ln 1.5 s, sigma=1.0), 0.2 s, 10 s) * --pause-scale [1]
    (median 1.5 s, mean ~2.3 s, ~10% of pauses over 5 s; one seeded random.Random per run, drawn
    agent by agent, turn by turn). The last turn's response ends the agent's job (the call it
    makes is never answered). Agents start staggered: uniform over [0, --stagger [2] {1} s).
  * KV pool: ~--pool-fraction [0.4] of the working set. Working set = the shared prefix once
    plus each agent's final conversation beyond it, in pages of --page-size [16] tokens, where
    a final conversation is the last turn's prompt plus its call. It is estimated BEFORE the run
    with the model's tokenizer (tokenizer_only, no weights) and the router's chat rendering
    (gateway.server.tokenization.template_inputs), with a placeholder call of max_tokens/2
    tokens per turn; the working set measured from the responses' usage is reported beside it.
    `--num-pages` = ceil(fraction x working-set pages), at least what the longest prompt needs.

Compared (each arm its own fresh server; the same num_pages everywhere):
  (a) ``lru``: ``--retention 0`` (pages of a finished request go to the LRU free queue).
  (b) ``retention``: the server's default retention (``--retention`` unset: 30 s, or the
      learned TTL where that landed), so a response ending in tool calls keeps its pages.
  (c) ``retention_tier``: (b) + ``--kv-tier host --kv-tier-size GB`` (--kv-tier-size [2 x the
      working set's bytes]); skipped with a message when `prefixgate serve` lacks the flags.
  (d) pause-free swarm (pauses 0), the same agents, today's default flags (``pause_free``) vs
      with the tier on (``pause_free_tier``), --pause-free-repeats [2] runs each on its server
      (every run a fresh ``cache_salt``, the pool reset between runs, so no run hits another's
      pages); throughput = completed turns / wall; ``throughput_ratio_pause_free_tier`` = tier /
      default of the medians (the repeats' spread shows the noise).

Reported per arm: job completion time per agent (its first request sent -> its last response
done, pauses included; p50/p90), prefill tokens computed (``prefill``: sum of prompt_tokens -
cached_tokens from usage.prompt_tokens_details, and the server's prefill_tokens_computed delta),
of which ``floor`` = what a pool that never evicts would still compute (each turn's new tool
result, chiefly; see ``prefill_floor``) and ``recomputed`` = prefill - floor: tokens the
session had already computed once and a cache could have served, computed again; the floor
counts every earlier call as unservable, so where calls re-tokenize as generated, a cache
that serves them goes below it and recomputed is negative: none), TTFT of
returning turns (turns >= 2; p50/p90) and of first turns, pool hit rate (/v1/cache/stats
global hit_rate over the run: hit tokens / query tokens), tier hit rate and retention counters
when the server reports them (any ``*tier*`` field of /v1/cache/stats and ``prefixgate:*tier*``
in /metrics), evictions, preemptions. Ratios against LRU: ``recompute_ratio_retention``,
``recompute_ratio_retention_tier`` (recomputed / LRU's recomputed), ``prefill_ratio_*`` (prefill
/ LRU's prefill), ``jct_p50_ratio_retention``, ``jct_p50_ratio_retention_tier``,
``ttft_returning_p50_ratio_*``, ``prefill_floor_ratio`` (floor / LRU's prefill: the best
prefill ratio possible); targets (issue #16): recompute <= 0.10, JCT p50 <= 0.6, pause-free
throughput within noise. Greedy decoding makes every arm generate the same tokens, so the arms
run the same conversations (checked: ``same_outputs_as_lru``).

    python -m benchmarks.agent_sessions --json out/agent_sessions.json
    python -m benchmarks.agent_sessions --quick --json out/agent_sessions_quick.json   # ~2-3 min
"""

from __future__ import annotations

import asyncio
import json
import math
import os
import random
import shlex
import statistics
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field, replace
from typing import Any

import httpx

from benchmarks.common import base_parser, bounded_schema, free_port, print_table, ratio, write_json
from benchmarks.server_process import ServerProcess
from prefixgate.agents import texts
from prefixgate.agents.report import percentile

PAUSE_MEDIAN_S = 1.5
PAUSE_SIGMA = 1.0
PAUSE_MIN_S, PAUSE_MAX_S = 0.2, 10.0
FP32_BYTES = 4
SERVER_START_TIMEOUT_S = 180
ARMS = ("lru", "retention", "retention_tier")
PAUSE_FREE_ARMS = ("pause_free", "pause_free_tier")


# ------------------------------------------------------------------------------ workload


@dataclass(frozen=True, slots=True)
class Workload:
    agents: int = 32
    turns: int = 6
    system_tokens: int = 1000
    tools: int = 14
    task_tokens: int = 60
    result_tokens: int = 200
    max_tokens: int = 96
    pause_scale: float = 1.0
    stagger_s: float = 2.0
    pool_fraction: float = 0.4
    page_size: int = 16
    seed: int = 0


QUICK = {"agents": 8, "turns": 3, "system_tokens": 200, "tools": 3, "task_tokens": 40,
         "result_tokens": 200, "max_tokens": 96, "stagger_s": 1.0}


@dataclass(frozen=True, slots=True)
class AgentPlan:
    index: int
    start_s: float  # offset from the run's start
    task: str
    pauses_s: tuple[float, ...]  # after turns 1..T-1


@dataclass(frozen=True, slots=True)
class Plan:
    system: str
    tools: tuple[dict[str, Any], ...]
    agents: tuple[AgentPlan, ...]


def draw_pause(rng: random.Random, scale: float = 1.0) -> float:
    """One tool pause: log-normal (median PAUSE_MEDIAN_S, sigma PAUSE_SIGMA) clipped to
    [PAUSE_MIN_S, PAUSE_MAX_S], then times ``scale`` (0 = a pause-free swarm)."""
    raw = rng.lognormvariate(math.log(PAUSE_MEDIAN_S), PAUSE_SIGMA)
    return min(max(raw, PAUSE_MIN_S), PAUSE_MAX_S) * scale


def tool_schemas(count: int) -> tuple[dict[str, Any], ...]:
    """The first ``count`` tools of agents.texts, bounded, with only their required parameters
    (the first one where none is required): a greedy 135M model fills every optional field up
    to its bound, and a call cut by max_tokens ends in "length", which retains nothing."""
    tools = []
    for spec in texts.TOOLS[:count]:
        tool = texts.tool_schema(*spec)
        parameters = tool["function"]["parameters"]
        required = parameters["required"] or list(parameters["properties"])[:1]
        parameters["properties"] = {k: v for k, v in parameters["properties"].items()
                                    if k in required}
        parameters["required"] = required
        tool["function"]["parameters"] = bounded_schema(parameters)
        tools.append(tool)
    return tuple(tools)


def make_plan(workload: Workload, pause_scale: float | None = None) -> Plan:
    """The run's shared prompt, tools, and each agent's task, start offset and pauses."""
    scale = workload.pause_scale if pause_scale is None else pause_scale
    text_rng = random.Random(workload.seed)
    instructions, _, policies = texts.system_prompt(text_rng, workload.system_tokens)
    system = texts.render_system(instructions, [], policies)
    timing_rng = random.Random(workload.seed + 1)
    agents = []
    for index in range(workload.agents):
        start = timing_rng.uniform(0, workload.stagger_s) if workload.stagger_s > 0 else 0.0
        pauses = tuple(draw_pause(timing_rng, scale) for _ in range(workload.turns - 1))
        agents.append(AgentPlan(index, start, texts.task(text_rng, workload.task_tokens), pauses))
    return Plan(system, tool_schemas(workload.tools), tuple(agents))


def tool_result_text(workload: Workload, agent: int, turn: int, tool_name: str) -> str:
    """The tool's output for ``agent``'s call at ``turn`` (seeded per agent and turn)."""
    rng = random.Random(workload.seed * 1_000_003 + agent * 1_009 + turn)
    return texts.tool_result(rng, tool_name, workload.result_tokens)


def opening_messages(plan: Plan, agent: AgentPlan) -> list[dict[str, Any]]:
    return [{"role": "system", "content": plan.system}, {"role": "user", "content": agent.task}]


def append_turn(messages: list[dict[str, Any]], workload: Workload, agent: int, turn: int,
                content: str | None, calls: list[dict[str, Any]]) -> None:
    """The assistant's reply and, per call, the tool's result (the next turn's prompt)."""
    if calls:
        messages.append({"role": "assistant", "content": content or None, "tool_calls": calls})
        for call in calls:
            messages.append({"role": "tool", "tool_call_id": call["id"], "content":
                             tool_result_text(workload, agent, turn, call["function"]["name"])})
    else:  # no parsable call: the text goes back and the "tool" answers as the user
        messages.append({"role": "assistant", "content": content or ""})
        messages.append({"role": "user", "content": tool_result_text(workload, agent, turn, "tool")})


# ------------------------------------------------------------------------------ pool sizing


@dataclass(frozen=True, slots=True)
class PoolSize:
    working_set_tokens: int  # shared prefix once + every agent's final conversation beyond it
    working_set_pages: int
    num_pages: int
    floor_applied: bool  # the fraction gave fewer pages than the longest prompt needs


def pool_size(shared_tokens: int, final_tokens: Sequence[int], fraction: float,
              page_size: int, min_pages: int = 0) -> PoolSize:
    """Pages for a pool of ``fraction`` of the working set.

    Args:
        shared_tokens: the prefix every agent shares (system prompt + tools), in tokens.
        final_tokens: per agent, its final conversation length in tokens (incl. the shared part).
        fraction: the pool's share of the working set (0.4 in the issue).
        page_size: tokens per page.
        min_pages: the least the pool may have (the longest prompt plus headroom).
    Returns:
        The working set in tokens and pages (the shared prefix's full pages counted once, each
        agent's rest rounded up to pages) and ``num_pages`` = max(ceil(fraction x pages), min).
    """
    shared_pages = shared_tokens // page_size  # only full blocks are shared
    shared_kept = shared_pages * page_size
    pages = shared_pages + sum(math.ceil((n - shared_kept) / page_size) for n in final_tokens)
    tokens = shared_tokens + sum(n - shared_tokens for n in final_tokens)
    wanted = math.ceil(fraction * pages)
    return PoolSize(tokens, pages, max(wanted, min_pages), wanted < min_pages)


def min_pool_pages(longest_prompt: int, max_tokens: int, page_size: int) -> int:
    """Room for the longest request (prompt + output) past the server's 10% admission
    watermark, plus a quarter: below that one agent alone thrashes the pool, not the pauses."""
    return math.ceil(1.25 * math.ceil((longest_prompt + max_tokens) / page_size) / 0.9)


class PromptCounter:
    """Prompt token counts as the gateway computes them (the router's rendering path)."""

    def __init__(self) -> None:
        from prefixgate.engine.loader.tokenizer_only import load_tokenizer_only

        self.loaded = load_tokenizer_only(None)

    def ids(self, messages: list[dict[str, Any]], tools: Sequence[dict[str, Any]]) -> list[int]:
        from prefixgate.gateway.server.openai.schemas import ChatCompletionRequest
        from prefixgate.gateway.server.tokenization import template_inputs

        chat = ChatCompletionRequest.model_validate(
            {"model": "x", "messages": messages, "tools": list(tools), "tool_choice": "required"})
        tokenizer = self.loaded.tokenizer
        prepared, template_tools = template_inputs(
            tokenizer, chat.template_messages(), chat.template_tools(), "messages")
        return list(tokenizer.apply_chat_template(prepared, template_tools, True))

    def count(self, messages: list[dict[str, Any]], tools: Sequence[dict[str, Any]]) -> int:
        return len(self.ids(messages, tools))

    def page_bytes(self, page_size: int) -> int:
        """K and V of one page over all layers, fp32 (the CPU default)."""
        from gguf import GGUFReader

        from prefixgate.engine.loader.gguf import _read_config

        reader = GGUFReader(self.loaded.path)
        shapes = {t.name: [int(d) for d in t.shape] for t in reader.tensors}
        config = _read_config(reader, self.loaded.path, shapes)
        return 2 * config.num_layers * config.num_kv_heads * config.head_dim * page_size * FP32_BYTES


def estimate_sizes(workload: Workload, plan: Plan, counter: PromptCounter
                   ) -> tuple[int, list[int]]:
    """(shared prefix tokens, each agent's estimated final conversation length in tokens)."""
    placeholder = "x" * max(1, workload.max_tokens // 2)  # ~1 token per 1-2 characters of JSON
    finals = []
    first_two = []
    for agent in plan.agents:
        messages = opening_messages(plan, agent)
        if len(first_two) < 2:
            first_two.append(messages)
        for turn in range(workload.turns - 1):
            name = plan.tools[turn % len(plan.tools)]["function"]["name"]
            call = {"id": f"call_{agent.index}_{turn}", "type": "function",
                    "function": {"name": name, "arguments": json.dumps({"q": placeholder})}}
            append_turn(messages, workload, agent.index, turn, None, [call])
        finals.append(counter.count(messages, plan.tools) + workload.max_tokens // 2)
    shared = shared_prefix_tokens(counter, plan, first_two)
    return shared, finals


def shared_prefix_tokens(counter: PromptCounter, plan: Plan,
                         openings: list[list[dict[str, Any]]]) -> int:
    """Tokens two agents' first prompts have in common (system prompt + tools + template)."""
    if len(openings) < 2:
        return counter.count(openings[0][:1], plan.tools)
    first, second = (counter.ids(messages, plan.tools) for messages in openings[:2])
    n = 0
    while n < min(len(first), len(second)) and first[n] == second[n]:
        n += 1
    return n


# ------------------------------------------------------------------------------ figures


def prefill_floor(turns: Sequence[Turn], shared_tokens: int, page_size: int) -> int:
    """Prefill tokens no cache can avoid: what a pool that never evicts would still compute.

    Per request: its prompt minus the full pages a cache could serve, capped one token short
    (the last prompt token is always computed): the shared prefix's full pages for a first
    turn (all of it for the first request sent), the previous prompt's full pages for a
    returning turn (its previous call is not counted: the next prompt re-tokenizes it, and
    the constrained decode spells it in other tokens than the tokenizer does, e.g. ' {' '"'
    where re-tokenizing gives ' {"', so the hit ends a few tokens into the call). The new
    tool result of every turn lands here.
    """
    floor = 0
    first_sent = min((t.sent_s for t in turns if t.turn == 1), default=None)
    previous: dict[int, Turn] = {}
    for record in sorted(turns, key=lambda t: (t.agent, t.turn)):
        if record.turn == 1:
            servable = 0 if record.sent_s == first_sent else shared_tokens // page_size * page_size
        else:
            before = previous.get(record.agent)
            servable = before.prompt_tokens // page_size * page_size if before else 0
        floor += record.prompt_tokens - min(servable, max(record.prompt_tokens - 1, 0))
        previous[record.agent] = record
    return floor


def comparison(arms: dict[str, dict[str, Any]]) -> dict[str, float | None]:
    """Each arm's figures over LRU's (None where an arm is missing), and pause-free tier / default."""
    lru = arms.get("lru")
    out: dict[str, float | None] = {}
    for arm in ("retention", "retention_tier"):
        row = arms.get(arm)
        for key, figure in (("recompute_ratio", "recomputed_tokens"),
                            ("prefill_ratio", "prefill_tokens"),
                            ("jct_p50_ratio", "jct_p50_s"),
                            ("jct_p90_ratio", "jct_p90_s"),
                            ("ttft_returning_p50_ratio", "ttft_returning_p50_s")):
            out[f"{key}_{arm}"] = (ratio(row.get(figure), lru.get(figure))
                                   if row is not None and lru is not None else None)
    # the best prefill_ratio any cache could reach: what a pool that never evicts computes
    out["prefill_floor_ratio"] = (ratio(lru.get("prefill_floor_tokens"), lru.get("prefill_tokens"))
                                    if lru is not None else None)
    default, tier = arms.get("pause_free"), arms.get("pause_free_tier")
    out["throughput_ratio_pause_free_tier"] = (
        ratio(tier.get("turns_per_s"), default.get("turns_per_s"))
        if default is not None and tier is not None else None)
    return out


# ------------------------------------------------------------------------------ one agent


@dataclass(slots=True)
class Turn:
    agent: int
    turn: int
    sent_s: float
    ttft_s: float | None = None
    done_s: float = 0.0
    prompt_tokens: int = 0
    cached_tokens: int = 0
    completion_tokens: int = 0
    finish_reason: str | None = None
    output: str = ""  # the call(s) as text, to check the arms generate the same


@dataclass(slots=True)
class StreamedReply:
    content: str = ""
    calls: dict[int, dict[str, Any]] = field(default_factory=dict)
    finish_reason: str | None = None
    usage: dict[str, Any] | None = None
    first_token_s: float | None = None

    def add(self, chunk: dict[str, Any], now: float) -> None:
        if chunk.get("usage"):
            self.usage = chunk["usage"]
        for choice in chunk.get("choices") or []:
            delta = choice.get("delta") or {}
            text = delta.get("content") or ""
            calls = delta.get("tool_calls") or []
            if (text or calls) and self.first_token_s is None:
                self.first_token_s = now
            self.content += text
            for part in calls:
                call = self.calls.setdefault(part["index"], {
                    "id": "", "type": "function", "function": {"name": "", "arguments": ""}})
                call["id"] = part.get("id") or call["id"]
                function = part.get("function") or {}
                call["function"]["name"] += function.get("name") or ""
                call["function"]["arguments"] += function.get("arguments") or ""
            if choice.get("finish_reason"):
                self.finish_reason = choice["finish_reason"]

    def tool_calls(self) -> list[dict[str, Any]]:
        return [self.calls[i] for i in sorted(self.calls)]


async def stream_turn(client: httpx.AsyncClient, body: dict[str, Any], record: Turn,
                      origin: float) -> StreamedReply:
    reply = StreamedReply()
    async with client.stream("POST", "/v1/chat/completions", json=body) as response:
        if response.status_code != 200:
            await response.aread()
            raise RuntimeError(f"agent {record.agent} turn {record.turn}: "
                               f"{response.status_code} {response.text[:300]}")
        async for line in response.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            reply.add(json.loads(line[6:]), time.perf_counter() - origin)
    record.done_s = time.perf_counter() - origin
    record.ttft_s = None if reply.first_token_s is None else reply.first_token_s - record.sent_s
    usage = reply.usage or {}
    record.prompt_tokens = usage.get("prompt_tokens", 0)
    record.cached_tokens = (usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0)
    record.completion_tokens = usage.get("completion_tokens", 0)
    record.finish_reason = reply.finish_reason
    record.output = json.dumps([reply.content, [c["function"] for c in reply.tool_calls()]])
    return reply


async def run_swarm(base_url: str, model: str, workload: Workload, plan: Plan,
                    cache_salt: str | None) -> tuple[list[Turn], float]:
    """Every agent's turns against ``base_url``; returns the turns and the wall time."""
    turns: list[Turn] = []
    origin = time.perf_counter()

    async def agent(client: httpx.AsyncClient, spec: AgentPlan) -> None:
        await asyncio.sleep(spec.start_s)
        messages = opening_messages(plan, spec)
        for turn in range(workload.turns):
            body: dict[str, Any] = {
                "model": model, "messages": messages, "tools": list(plan.tools),
                "tool_choice": "required", "parallel_tool_calls": False, "temperature": 0,
                "max_tokens": workload.max_tokens, "stream": True,
                "stream_options": {"include_usage": True}, "user": f"agent-{spec.index}"}
            if cache_salt:
                body["cache_salt"] = cache_salt
            record = Turn(spec.index, turn + 1, time.perf_counter() - origin)
            turns.append(record)
            reply = await stream_turn(client, body, record, origin)
            if turn == workload.turns - 1:
                return
            append_turn(messages, workload, spec.index, turn, reply.content, reply.tool_calls())
            if spec.pauses_s[turn] > 0:
                await asyncio.sleep(spec.pauses_s[turn])

    # keepalive_expiry below the server's --keep-alive-timeout (5 s): a pause never lands a
    # request on a socket the server is closing
    limits = httpx.Limits(max_connections=workload.agents + 4, keepalive_expiry=2.0)
    async with httpx.AsyncClient(base_url=base_url, timeout=900, limits=limits) as client:
        await asyncio.gather(*(agent(client, spec) for spec in plan.agents))
    return turns, time.perf_counter() - origin


def summarise(turns: list[Turn], wall_s: float, shared_tokens: int = 0,
              page_size: int = 16) -> dict[str, Any]:
    """Per-arm figures from the client's records."""
    by_agent: dict[int, list[Turn]] = {}
    for record in turns:
        by_agent.setdefault(record.agent, []).append(record)
    jct = [max(t.done_s for t in ts) - min(t.sent_s for t in ts) for ts in by_agent.values()]
    returning = [t.ttft_s for t in turns if t.turn >= 2 and t.ttft_s is not None]
    first = [t.ttft_s for t in turns if t.turn == 1 and t.ttft_s is not None]
    prompt = sum(t.prompt_tokens for t in turns)
    cached = sum(t.cached_tokens for t in turns)
    returning_prompt = sum(t.prompt_tokens for t in turns if t.turn >= 2)
    returning_cached = sum(t.cached_tokens for t in turns if t.turn >= 2)
    finals = {}
    for agent, ts in by_agent.items():
        last = max(ts, key=lambda t: t.turn)
        finals[agent] = last.prompt_tokens + last.completion_tokens
    return {
        "wall_s": wall_s,
        "requests": len(turns),
        "turns_per_s": len(turns) / wall_s if wall_s else None,
        "jct_p50_s": percentile(jct, 50),
        "jct_p90_s": percentile(jct, 90),
        "ttft_returning_p50_s": percentile(returning, 50),
        "ttft_returning_p90_s": percentile(returning, 90),
        "ttft_first_p50_s": percentile(first, 50),
        "prompt_tokens": prompt,
        "cached_tokens": cached,
        "prefill_tokens": prompt - cached,
        # what no cache avoids (every turn's new tool result, ...) and the rest, computed once
        # already by the session: recomputed, which a cache could have served
        "prefill_floor_tokens": (floor := prefill_floor(turns, shared_tokens, page_size)),
        "recomputed_tokens": prompt - cached - floor,
        "prefill_tokens_returning": returning_prompt - returning_cached,
        "returning_hit_rate": returning_cached / returning_prompt if returning_prompt else None,
        "completion_tokens": sum(t.completion_tokens for t in turns),
        "finish_tool_calls": sum(t.finish_reason == "tool_calls" for t in turns),
        "cut_calls": sum(t.finish_reason == "length" for t in turns),
        "final_conversation_tokens": [finals[a] for a in sorted(finals)],
    }


# ------------------------------------------------------------------------------ servers


def serve_flags() -> set[str]:
    """The long flags `prefixgate serve` takes (to skip an arm whose flags are not there)."""
    out = subprocess.run([sys.executable, "-m", "prefixgate.gateway.cli", "serve", "--help"],
                         capture_output=True, text=True, check=True, timeout=120).stdout
    return {word.strip("[],") for word in out.split() if word.startswith("--")}


class Server(ServerProcess):
    """One `prefixgate serve` subprocess on a free port, stopped by its PID."""

    def __init__(self, name: str, flags: list[str]):
        port = free_port()
        super().__init__(name, [sys.executable, "-m", "prefixgate.gateway.cli", "serve",
                                "--host", "127.0.0.1", "--port", str(port),
                                "--log-level", "warning", *flags], port)

    def wait_ready(self, timeout_s: float = SERVER_START_TIMEOUT_S) -> str:  # type: ignore[override]
        """Blocks until /v1/models answers; returns the served model name."""
        return super().wait_ready(timeout_s)[1][0]


def cache_stats(base_url: str) -> dict[str, Any]:
    response = httpx.get(base_url + "/v1/cache/stats", timeout=30)
    response.raise_for_status()
    return response.json()


def metrics(base_url: str) -> dict[str, float]:
    """``prefixgate:*`` samples by name and labels (model_name dropped; no histogram buckets)."""
    response = httpx.get(base_url + "/metrics", timeout=30)
    response.raise_for_status()
    out = {}
    for line in response.text.splitlines():
        if not line.startswith("prefixgate:") or "_bucket{" in line or "_created{" in line:
            continue
        sample, _, value = line.rpartition(" ")
        name, _, labels = sample.partition("{")
        kept = [pair for pair in labels.rstrip("}").split(",")
                if pair and not pair.startswith("model_name=")]
        try:
            out[name + ("{" + ",".join(kept) + "}" if kept else "")] = float(value)
        except ValueError:
            continue
    return out


def tier_fields(stats: Any, path: str = "") -> dict[str, Any]:
    """Every field of /v1/cache/stats whose name mentions a tier, flattened (``a.b``)."""
    out: dict[str, Any] = {}
    if isinstance(stats, dict):
        for key, value in stats.items():
            name = f"{path}.{key}" if path else key
            if "tier" in key.lower():
                if isinstance(value, dict):
                    out.update({f"{name}.{k}": v for k, v in _flatten(value).items()})
                else:
                    out[name] = value
            elif isinstance(value, dict) and key not in ("per_agent", "per_tenant"):
                out.update(tier_fields(value, name))
    return out


def _flatten(value: dict[str, Any], path: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, item in value.items():
        name = f"{path}.{key}" if path else key
        if isinstance(item, dict):
            out.update(_flatten(item, name))
        elif not isinstance(item, list):
            out[name] = item
    return out


def delta(after: dict[str, Any], before: dict[str, Any]) -> dict[str, Any]:
    """after - before for the numbers (counters over the run); gauges come out as a change."""
    return {k: (v - before[k] if isinstance(v, int | float) and isinstance(before.get(k), int | float)
                and not isinstance(v, bool) else v) for k, v in after.items()}


def server_figures(before: dict[str, Any], after: dict[str, Any], metrics_before: dict[str, float],
                   metrics_after: dict[str, float]) -> dict[str, Any]:
    """Pool/retention/tier figures over the run from /v1/cache/stats and /metrics."""
    g0, g1 = before["global"], after["global"]
    query = g1["query_tokens"] - g0["query_tokens"]
    hits = g1["hit_tokens"] - g0["hit_tokens"]
    engine0, engine1 = before["engine"], after["engine"]
    out: dict[str, Any] = {
        "pool_hit_rate": hits / query if query else None,
        "server_query_tokens": query,
        "server_hit_tokens": hits,
        "server_prefill_tokens_computed": (engine1["prefill_tokens_computed"]
                                           - engine0["prefill_tokens_computed"]),
        "evictions": after["evictions"] - before["evictions"],
        "preemptions": engine1["num_preemptions"] - engine0["num_preemptions"],
        "retained_evicted": after.get("retained_evicted", 0) - before.get("retained_evicted", 0),
        "retention_expiries": (after.get("retention_expiries", 0)
                               - before.get("retention_expiries", 0)),
        # hits on pages that survived because retention kept them (when the server counts them)
        "retention_hit_tokens": (g1["retention_hit_tokens"] - g0.get("retention_hit_tokens", 0)
                                 if "retention_hit_tokens" in g1 else None),
        "pages_retained_end": after.get("pages_retained"),
        "num_pages": after["num_pages"],
    }
    tier = delta(tier_fields(after), tier_fields(before))
    out["tier_stats"] = tier
    out["tier_metrics"] = {k: v - metrics_before.get(k, 0.0) for k, v in metrics_after.items()
                           if "tier" in k}
    out["retention_metrics"] = {k: v - metrics_before.get(k, 0.0) for k, v in metrics_after.items()
                                if "retain" in k or "retention" in k}
    # tier hit rate: tier-hit tokens (or pages x page size) over the run's query tokens
    tier_hit_tokens = next((v for k, v in tier.items() if k.endswith(("tokens_loaded", "hit_tokens"))
                            and isinstance(v, int | float)), None)
    if tier_hit_tokens is None:
        for k, v in {**tier, **out["tier_metrics"]}.items():
            if ("hit" in k or "loaded" in k) and "page" in k and isinstance(v, int | float):
                tier_hit_tokens = v * after["page_size"]
                break
    out["tier_hit_tokens"] = tier_hit_tokens
    out["tier_hit_rate"] = ratio(tier_hit_tokens, query) if tier_hit_tokens is not None else None
    return out


def warm_up(base_url: str, model: str, plan: Plan, max_tokens: int) -> None:
    """One request in its own cache_salt (the grammar compile, first-use kernel builds), then
    the pool is reset so the timed run starts cold."""
    body = {"model": model, "messages": [{"role": "system", "content": plan.system},
                                         {"role": "user", "content": "Warm up."}],
            "tools": list(plan.tools), "tool_choice": "required", "parallel_tool_calls": False,
            "temperature": 0, "max_tokens": max_tokens, "cache_salt": "warmup"}
    httpx.post(base_url + "/v1/chat/completions", json=body, timeout=300).raise_for_status()
    reset(base_url)


def reset(base_url: str) -> None:
    httpx.post(base_url + "/v1/cache/reset", timeout=60).raise_for_status()


def run_arm(name: str, flags: list[str], workload: Workload, plans: list[Plan],
            salts: list[str | None], shared_tokens: int) -> list[dict[str, Any]]:
    """Start a server with ``flags``, run each plan (with its cache_salt) in turn, stop it."""
    print(f"[{time.strftime('%H:%M:%S')}] {name}: serve {' '.join(flags)}", flush=True)
    server = Server(name, flags)
    results = []
    try:
        started = time.perf_counter()
        model = server.wait_ready()
        startup_s = time.perf_counter() - started
        warm_up(server.base_url, model, plans[0], workload.max_tokens)
        for i, (plan, salt) in enumerate(zip(plans, salts, strict=True)):
            if i:
                reset(server.base_url)
            before, metrics_before = cache_stats(server.base_url), metrics(server.base_url)
            turns, wall = asyncio.run(run_swarm(server.base_url, model, workload, plan, salt))
            time.sleep(0.3)  # background retention tasks, final counters
            after, metrics_after = cache_stats(server.base_url), metrics(server.base_url)
            row = {"arm": name, "flags": flags, "server_startup_s": startup_s,
                   **summarise(turns, wall, shared_tokens, workload.page_size),
                   **server_figures(before, after, metrics_before, metrics_after),
                   "outputs": [t.output for t in sorted(turns, key=lambda t: (t.agent, t.turn))],
                   "turn_records": [{k: v for k, v in asdict(t).items() if k != "output"}
                                    for t in sorted(turns, key=lambda t: (t.agent, t.turn))]}
            if row["cut_calls"]:
                print(f"    WARNING: {row['cut_calls']} of {row['requests']} calls cut by "
                      "max_tokens (finish 'length'): those turns retain nothing", flush=True)
            print(f"    run {i + 1}/{len(plans)}: wall {wall:.1f} s, jct p50 "
                  f"{row['jct_p50_s']:.2f} s, prefill {row['prefill_tokens']}, recomputed {row['recomputed_tokens']}, "
                  f"pool hit rate {row['pool_hit_rate'] or 0:.3f}", flush=True)
            results.append(row)
    except Exception:
        print(f"server {name} log tail:\n{server.log_tail()}", file=sys.stderr)
        raise
    finally:
        server.stop()
    return results


def median_row(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """Repeats of one arm: the medians of its numeric figures, plus each repeat's throughput."""
    out = dict(rows[0])
    for key, value in rows[0].items():
        if isinstance(value, int | float) and not isinstance(value, bool):
            values = [r[key] for r in rows if isinstance(r.get(key), int | float)]
            out[key] = statistics.median(values) if values else None
    out["turns_per_s_repeats"] = [r["turns_per_s"] for r in rows]
    out["wall_s_repeats"] = [r["wall_s"] for r in rows]
    return out


# ------------------------------------------------------------------------------ main


def main() -> None:
    parser = base_parser(__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true",
                        help="8 agents x 3 turns, short prompts (~2-3 min in all)")
    parser.add_argument("--agents", type=int, default=None, help="[32] {8}")
    parser.add_argument("--turns", type=int, default=None, help="[6] {3}")
    parser.add_argument("--system-tokens", type=int, default=None, help="[1000] {200}")
    parser.add_argument("--tools", type=int, default=None, help="tool schemas shared [14] {3}")
    parser.add_argument("--task-tokens", type=int, default=None, help="[60] {40}")
    parser.add_argument("--result-tokens", type=int, default=None, help="[200] {200}")
    parser.add_argument("--max-tokens", type=int, default=None, help="per turn [96] {96}")
    parser.add_argument("--pause-scale", type=float, default=1.0, help="tool pauses x this [1]")
    parser.add_argument("--stagger", type=float, default=None, help="start spread, s [2] {1}")
    parser.add_argument("--pool-fraction", type=float, default=0.4,
                        help="KV pool / working set [0.4]")
    parser.add_argument("--page-size", type=int, default=16)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--kv-tier-size", type=float, default=None,
                        help="host tier GB [2 x the working set's KV bytes]")
    parser.add_argument("--pause-free-repeats", type=int, default=2,
                        help="runs per pause-free arm [2]; 0 skips (d)")
    parser.add_argument("--retention-args", default="",
                        help="extra serve flags for every arm but LRU, e.g. "
                             "'--retention-tenant-budget 0.5' (default: none, the server's defaults)")
    parser.add_argument("--arms", default=",".join(ARMS + PAUSE_FREE_ARMS),
                        help="comma-separated subset of " + ",".join(ARMS + PAUSE_FREE_ARMS))
    args = parser.parse_args()
    preset = QUICK if args.quick else {}
    given = {"agents": args.agents, "turns": args.turns, "system_tokens": args.system_tokens,
             "tools": args.tools, "task_tokens": args.task_tokens,
             "result_tokens": args.result_tokens, "max_tokens": args.max_tokens,
             "stagger_s": args.stagger}
    workload = replace(Workload(pause_scale=args.pause_scale, pool_fraction=args.pool_fraction,
                                page_size=args.page_size, seed=args.seed),
                       **{**preset, **{k: v for k, v in given.items() if v is not None}})
    if workload.turns < 1 or workload.agents < 1:
        parser.error("--agents and --turns must be >= 1")
    wanted = [a.strip() for a in args.arms.split(",") if a.strip()]
    unknown = set(wanted) - set(ARMS + PAUSE_FREE_ARMS)
    if unknown:
        parser.error(f"unknown arms: {sorted(unknown)}")

    started = time.perf_counter()
    plan = make_plan(workload)
    counter = PromptCounter()
    shared, finals = estimate_sizes(workload, plan, counter)
    longest = max(finals)
    size = pool_size(shared, finals, workload.pool_fraction, workload.page_size,
                     min_pool_pages(longest, workload.max_tokens, workload.page_size))
    page_bytes = counter.page_bytes(workload.page_size)
    tier_gb = args.kv_tier_size or max(0.25, round(2 * size.working_set_pages * page_bytes / 2**30,
                                                   3))
    flags_available = serve_flags()
    tier_ok = {"--kv-tier", "--kv-tier-size"} <= flags_available
    pool = ["--num-pages", str(size.num_pages), "--page-size", str(workload.page_size)]
    tier = ["--kv-tier", "host", "--kv-tier-size", f"{tier_gb:g}"]
    extra = shlex.split(args.retention_args)
    arm_flags = {"lru": [*pool, "--retention", "0"], "retention": [*pool, *extra],
                 "retention_tier": [*pool, *extra, *tier], "pause_free": [*pool, *extra],
                 "pause_free_tier": [*pool, *extra, *tier]}
    pauses = [p for a in plan.agents for p in a.pauses_s]
    results: dict[str, Any] = {
        "workload": {**asdict(workload), "pause_distribution":
                     f"clip(lognormal(median {PAUSE_MEDIAN_S} s, sigma {PAUSE_SIGMA}), "
                     f"{PAUSE_MIN_S}, {PAUSE_MAX_S}) x pause_scale"},
        "quick": args.quick,
        "retention_args": extra,
        "shared_prefix_tokens": shared,
        "working_set_tokens_estimated": size.working_set_tokens,
        "working_set_pages_estimated": size.working_set_pages,
        "num_pages": size.num_pages,
        "pool_floor_applied": size.floor_applied,
        "page_bytes": page_bytes,
        "kv_tier_size_gb": tier_gb,
        "kv_tier_flags_available": tier_ok,
        "pause_s_p50": percentile(pauses, 50),
        "pause_s_p90": percentile(pauses, 90),
        "pause_s_mean": statistics.mean(pauses) if pauses else None,
        "pause_s_total": sum(pauses),
        "loadavg_1min_start": os.getloadavg()[0],
        "skipped": {},
    }
    print(f"workload: {workload.agents} agents x {workload.turns} turns, shared prefix {shared} "
          f"tokens, working set ~{size.working_set_tokens} tokens = {size.working_set_pages} "
          f"pages -> --num-pages {size.num_pages}"
          + (" (floor: the longest prompt)" if size.floor_applied else ""), flush=True)

    arms: dict[str, dict[str, Any]] = {}
    for name in ARMS + PAUSE_FREE_ARMS:
        if name not in wanted:
            continue
        if "tier" in name and not tier_ok:
            message = ("`prefixgate serve` has no --kv-tier/--kv-tier-size flags yet "
                       "(the host tier has not landed): arm skipped")
            print(f"[skip] {name}: {message}", flush=True)
            results["skipped"][name] = message
            continue
        if name in PAUSE_FREE_ARMS:
            if args.pause_free_repeats <= 0:
                continue
            free_plan = make_plan(workload, pause_scale=0.0)
            repeats = args.pause_free_repeats
            rows = run_arm(name, arm_flags[name], workload, [free_plan] * repeats,
                           [f"pause-free-{i}" for i in range(repeats)], shared)
            arms[name] = median_row(rows)
        else:
            arms[name] = run_arm(name, arm_flags[name], workload, [plan], [None], shared)[0]

    lru_outputs = arms["lru"]["outputs"] if "lru" in arms else None
    for name, row in arms.items():
        outputs = row.pop("outputs")
        if name in ARMS and lru_outputs is not None:
            row["same_outputs_as_lru"] = outputs == lru_outputs
    if "lru" in arms:
        finals_measured = arms["lru"]["final_conversation_tokens"]
        measured = pool_size(shared, finals_measured, workload.pool_fraction, workload.page_size)
        results["working_set_tokens_measured"] = measured.working_set_tokens
        results["working_set_pages_measured"] = measured.working_set_pages
        results["pool_over_working_set_measured"] = size.num_pages / measured.working_set_pages
    results.update(comparison(arms))
    results["arms"] = arms
    results["bench_wall_s"] = time.perf_counter() - started
    results["loadavg_1min_end"] = os.getloadavg()[0]
    print_report(results, arms)
    write_json(args.json, results)


def print_report(results: dict[str, Any], arms: dict[str, dict[str, Any]]) -> None:
    columns = [("jct p50 s", "jct_p50_s"), ("jct p90 s", "jct_p90_s"),
               ("prefill", "prefill_tokens"), ("floor", "prefill_floor_tokens"),
               ("recomputed", "recomputed_tokens"), ("ttft ret p50", "ttft_returning_p50_s"),
               ("ttft ret p90", "ttft_returning_p90_s"), ("pool hit", "pool_hit_rate"),
               ("tier hit", "tier_hit_rate"), ("evictions", "evictions"),
               ("ret. evicted", "retained_evicted"), ("turns/s", "turns_per_s"),
               ("wall s", "wall_s")]
    print("\nagent sessions (benchmarks.agent_sessions)")
    header = f"{'arm':<16}" + "".join(f"{title:>13}" for title, _ in columns)
    print(header + "\n" + "-" * len(header))
    for name, row in arms.items():
        cells = []
        for _, key in columns:
            value = row.get(key)
            cells.append(f"{'-' if value is None else format(value, '.3g'):>13}"
                         if not isinstance(value, int) else f"{value:>13}")
        print(f"{name:<16}" + "".join(cells))
    for name, message in results["skipped"].items():
        print(f"{name:<16}  skipped: {message}")
    print_table("vs LRU (targets: recompute <= 0.1, jct p50 <= 0.6; pause-free tier ~ 1; "
                "recomputed = prefill - floor)",
                [(k, "-" if v is None else v) for k, v in results.items()
                 if k.endswith(("_retention", "_retention_tier", "_pause_free_tier"))])
    print_table("workload", [(k, v) for k, v in results.items()
                             if not isinstance(v, dict | list) and not k.endswith(
                                 ("_retention", "_retention_tier", "_pause_free_tier"))])


if __name__ == "__main__":
    main()
