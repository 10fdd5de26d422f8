"""Offline engine benchmark on the default model: an agent swarm with a shared system prompt.

Workload (deterministic, seed 0): one ~2,000-token system prompt (role, rules, JSON tool
schemas, policies from agents.texts), 16 agents, 3 turns each, exactly 32 output tokens per
turn (greedy, ignore_eos). Turn 1 = system + the agent's task (~60 tokens); each later turn
re-sends the whole conversation: + the assistant's reply + a ~40-token follow-up. All 16 agents
start together (a burst); an agent sends its next turn as soon as its previous one finishes.

Measured in one run, same machine, same weights:
  * prefixgate with prefix caching (wall_cached_s) and with caching off (wall_uncached_s);
  * transformers ``generate`` one request at a time (fp32, its own KV cache). It is slow here,
    so it runs a subset of requests covering every turn (--hf-agents agents x 3 turns, >= 8
    requests) and ``wall_transformers_s`` extrapolates the per-turn means to all 48 requests
    (``transformers_estimated: true``); --hf-agents 16 measures everything;
  * the floor: for each warm request (its prefix cached when it was sent: turns 2 and 3), the
    time of a forward pass over its uncached suffix alone with its prefix already in the pages
    (median of 3); ``warm_ttft_over_floor`` = median over warm requests of (TTFT in the swarm
    run / floor). TTFT in the swarm run includes sharing each step with other agents' work,
    which is what a client sees: in this lockstep burst all 16 agents send their next turn in
    the same instant, so each warm suffix is prefilled in one step with 15 others.
    ``warm_ttft_isolated_over_floor`` replays warm requests one at a time;
    ``warm_ttft_over_floor_tool_latency`` re-runs the cached swarm with each agent pausing
    for its tool call between turns (exponential, mean ``--tool-latency-s``, seeded), so
    arrivals spread out as they do in real agent loops.
  * ``prefill_tokens_ideal`` counts every distinct prefix once (token-level longest common
    prefix against all earlier requests); ``prefill_tokens_computed`` is what the engine ran.
"""

from __future__ import annotations

import random
import statistics
import time
from dataclasses import dataclass, field

import torch

from benchmarks.common import base_parser, print_table, write_json
from prefixgate.agents import texts
from prefixgate.engine.api import Delta, GenerationRequest, SamplingParams
from prefixgate.engine.build import create_llm_engine
from prefixgate.engine.config import EngineConfig
from prefixgate.engine.loader import load_model
from prefixgate.engine.runner import ModelRunner, SeqChunk

NUM_AGENTS, NUM_TURNS, MAX_TOKENS = 16, 3, 32
SYSTEM_TOKENS, TASK_TOKENS, FOLLOWUP_TOKENS = 2150, 50, 35  # approx budgets -> ~2,000 real tokens


@dataclass
class Agent:
    messages: list[dict]
    followups: list[str]
    turn: int = 0
    records: list[dict] = field(default_factory=list)


def build_agents(seed: int = 0) -> list[Agent]:
    rng = random.Random(seed)
    system = texts.render_system(*texts.system_prompt(rng, SYSTEM_TOKENS))
    agents = []
    for _ in range(NUM_AGENTS):
        agents.append(Agent(
            messages=[{"role": "system", "content": system},
                      {"role": "user", "content": texts.task(rng, TASK_TOKENS)}],
            followups=[texts.followup(rng, FOLLOWUP_TOKENS) for _ in range(NUM_TURNS - 1)],
        ))
    return agents


def ideal_prefill(prompts: list[list[int]], earlier: list[list[int]]) -> int:
    """Each distinct prefix once: sum of (len - longest common prefix with anything computed
    before it). ``earlier[i]`` = what was in KV before prompt i was sent: the earlier prompts
    and, for an agent's later turns, its previous turns' generated tokens (all but the last,
    which is sampled but never computed)."""
    total = 0
    for p, before in zip(prompts, earlier, strict=True):
        lcp = 0
        for q in before:
            n, m = 0, min(len(p), len(q))
            while n < m and p[n] == q[n]:
                n += 1
            lcp = max(lcp, n)
        total += len(p) - min(lcp, len(p) - 1)
    return total


def run_swarm(engine, tokenizer, tool_latency_s: float = 0.0, seed: int = 0) -> dict:
    """Drive the agents through the sync engine; return per-request records and wall time.

    ``tool_latency_s``: mean of the exponential pause (the agent running its tool) between a
    turn's last token and the agent's next request; 0 = the next turn is sent at once.
    """
    agents = build_agents()
    think = random.Random(seed + 1)
    due: list[tuple[float, int, Agent]] = []  # (send time, agent index, agent) of paused agents
    submitted: dict[str, tuple[Agent, float, list[int]]] = {}
    outputs: dict[str, list[Delta]] = {}
    order: list[list[int]] = []
    earlier: list[list[list[int]]] = []
    computed: list[list[int]] = []  # every prompt sent + every finished prompt+output

    def submit(i: int, agent: Agent) -> None:
        prompt = tokenizer.apply_chat_template(agent.messages)
        rid = f"a{i}t{agent.turn}"
        outputs[rid] = []
        engine.add_request(
            GenerationRequest(tuple(prompt), SamplingParams(max_tokens=MAX_TOKENS, temperature=0, ignore_eos=True),
                              request_id=rid, agent=f"agent-{i}"),
            outputs[rid].append)
        submitted[rid] = (agent, time.perf_counter(), prompt)
        order.append(prompt)
        earlier.append(list(computed))  # snapshot: what had KV before this prompt arrived
        computed.append(prompt)

    t0 = time.perf_counter()
    for i, agent in enumerate(agents):
        submit(i, agent)
    first_token: dict[str, float] = {}
    while engine.has_work() or due:
        now = time.perf_counter()
        for entry in [d for d in due if d[0] <= now]:
            due.remove(entry)
            submit(entry[1], entry[2])
        if not engine.has_work():
            time.sleep(max(0.0, min(d[0] for d in due) - now))
            continue
        engine.step()
        now = time.perf_counter()
        for rid, deltas in list(outputs.items()):
            if deltas and rid not in first_token:
                first_token[rid] = now
            if deltas and deltas[-1].usage is not None and rid in submitted:
                agent, start, prompt = submitted.pop(rid)
                usage = deltas[-1].usage
                computed.append(prompt + [t for d in deltas for t in d.token_ids][:-1])
                agent.records.append({"request": rid, "prompt_tokens": usage.prompt_tokens,
                                      "cached_tokens": usage.cached_tokens, "ttft_s": first_token[rid] - start,
                                      "e2e_s": now - start, "prompt": prompt})
                agent.turn += 1
                if agent.turn < NUM_TURNS:
                    reply = "".join(d.text for d in deltas)
                    agent.messages += [{"role": "assistant", "content": reply},
                                       {"role": "user", "content": agent.followups[agent.turn - 1]}]
                    index = int(rid[1 : rid.index("t")])
                    if tool_latency_s > 0:
                        due.append((now + think.expovariate(1 / tool_latency_s), index, agent))
                    else:
                        submit(index, agent)
    wall = time.perf_counter() - t0
    return {"wall_s": wall, "agents": agents, "order": order, "earlier": earlier,
            "prefill_tokens_computed": engine.prefill_tokens_computed}


def warm_records(run: dict) -> list[dict]:
    """Requests whose prefix was cached when they were sent: every agent's turns 2 and 3.

    Turn-1 requests also report cached tokens (in-flight dedup: they waited while the first
    one computed the shared prompt), but that wait is the prompt's first computation, not a
    warm request's overhead, so they are not counted here.
    """
    return [rec for agent in run["agents"] for rec in agent.records[1:] if rec["cached_tokens"] > 0]


def suffix_floor(runner: ModelRunner, prompt: list[int], cached: int) -> float:
    """Forward time of the uncached suffix alone, attending over a ``cached``-token prefix.

    Attention cost does not depend on what the prefix pages hold, so they are not recomputed
    here (that would cost a full prefill per sample); the pages are just read.
    """
    ps = runner.page_size
    table = list(range(-(-len(prompt) // ps)))
    samples = []
    for _ in range(3):
        t = time.perf_counter()
        logits = runner.execute([SeqChunk(prompt[cached:], cached, table, True)])
        logits.cpu()  # waits for the device (a no-op wait on CPU)
        samples.append(time.perf_counter() - t)
    return statistics.median(samples)


def transformers_subset(
    loaded, agents: list[Agent], hf_agents: int, device: str = "cpu"
) -> tuple[float, dict[int, float]]:
    from transformers import AutoModelForCausalLM

    path = loaded.path
    # the same dtype as ours: fp32 on CPU, bf16 on GPU
    dtype = torch.float32 if device == "cpu" else torch.bfloat16
    model = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=dtype)
    model = model.to(device).eval()
    per_turn: dict[int, list[float]] = {t: [] for t in range(NUM_TURNS)}
    with torch.inference_mode():
        for agent in agents[:hf_agents]:
            for turn, rec in enumerate(agent.records):
                ids = torch.tensor([rec["prompt"]], device=device)
                t = time.perf_counter()
                model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=MAX_TOKENS,
                               min_new_tokens=MAX_TOKENS, do_sample=False)
                per_turn[turn].append(time.perf_counter() - t)
    means = {t: statistics.mean(v) for t, v in per_turn.items()}
    return sum(means[t] * NUM_AGENTS for t in range(NUM_TURNS)), means


def main() -> None:
    parser = base_parser(__doc__.splitlines()[0])
    parser.add_argument("--hf-agents", type=int, default=3, help="agents replayed through transformers (x3 turns)")
    parser.add_argument("--num-pages", type=int, default=4096)
    parser.add_argument("--device", default=None, help="cpu / cuda (default: cuda when available)")
    parser.add_argument("--max-num-batched-tokens", type=int, default=None,
                        help="step token budget (default: the engine's, 192 on CPU / 2048 on GPU)")
    parser.add_argument("--tool-latency-s", type=float, default=1.0,
                        help="mean tool pause between turns in the second cached run (exponential)")
    args = parser.parse_args()
    loaded = load_model(None)
    tok = loaded.tokenizer
    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    common = dict(num_pages=args.num_pages, page_size=16, device=device,
                  max_num_batched_tokens=args.max_num_batched_tokens)

    cached_engine, info = create_llm_engine(EngineConfig(**common), loaded=loaded)
    cached = run_swarm(cached_engine, tok)
    uncached_engine, _ = create_llm_engine(EngineConfig(**common, enable_prefix_caching=False), loaded=loaded)
    uncached = run_swarm(uncached_engine, tok)
    del uncached_engine

    # The floor and isolated TTFT, per warm request of the cached run.
    runner = cached_engine.runner
    warm = warm_records(cached)
    ratios = [rec["ttft_s"] / suffix_floor(runner, rec["prompt"], rec["cached_tokens"]) for rec in warm]
    isolated = []
    cached_engine.scheduler.cache.reset_cache()
    for rec in warm[:: max(1, len(warm) // 8)]:  # isolated replay: warm its prefix, then time it
        prompt = rec["prompt"]
        warmup = GenerationRequest(tuple(prompt[: rec["cached_tokens"]] + [0]), SamplingParams(max_tokens=1))
        cached_engine.add_request(warmup, lambda d: None)
        while cached_engine.has_work():
            cached_engine.step()
        seen: list[Delta] = []
        t = time.perf_counter()
        cached_engine.add_request(GenerationRequest(tuple(prompt), SamplingParams(max_tokens=1, temperature=0)),
                                  seen.append)
        while not seen:
            cached_engine.step()
        ttft = time.perf_counter() - t
        while cached_engine.has_work():
            cached_engine.step()
        isolated.append(ttft / suffix_floor(runner, prompt, rec["cached_tokens"]))

    # The same swarm with each agent pausing for its tool between turns: arrivals spread out.
    cached_engine.scheduler.cache.reset_cache()
    paused = run_swarm(cached_engine, tok, tool_latency_s=args.tool_latency_s)
    paused_ratios = [
        rec["ttft_s"] / suffix_floor(runner, rec["prompt"], rec["cached_tokens"]) for rec in warm_records(paused)
    ]

    hf_agents = max(3, args.hf_agents)
    wall_hf, hf_means = transformers_subset(loaded, cached["agents"], hf_agents, device)
    results = {
        "workload": f"{NUM_AGENTS} agents x {NUM_TURNS} turns, ~2k shared system prompt, {MAX_TOKENS} output tokens",
        "system_prompt_tokens": len(tok.apply_chat_template(cached["agents"][0].messages[:1], add_generation_prompt=False)),
        "num_requests": len(cached["order"]),
        "wall_cached_s": cached["wall_s"],
        "wall_uncached_s": uncached["wall_s"],
        "wall_transformers_s": wall_hf,
        "transformers_estimated": hf_agents < NUM_AGENTS,
        "transformers_requests_measured": hf_agents * NUM_TURNS,
        "transformers_mean_s_per_turn": hf_means,
        "prefill_tokens_computed": cached["prefill_tokens_computed"],
        "prefill_tokens_uncached_run": uncached["prefill_tokens_computed"],
        "prefill_tokens_ideal": ideal_prefill(cached["order"], cached["earlier"]),
        "warm_ttft_over_floor": statistics.median(ratios),
        "warm_ttft_isolated_over_floor": statistics.median(isolated),
        "warm_requests": len(warm),
        "tool_latency_mean_s": args.tool_latency_s,
        "warm_ttft_over_floor_tool_latency": statistics.median(paused_ratios),
        "wall_cached_tool_latency_s": paused["wall_s"],
        "cached_over_transformers": cached["wall_s"] / wall_hf,
        "uncached_over_cached": uncached["wall_s"] / cached["wall_s"],
        "device": info["device"],
        "kernel_backend": info["kernel_backend"],
        "kv_dtype": info["kv_dtype"],
        "native_cpu_kernels": info["native_cpu_kernels"],
        "max_num_batched_tokens": cached_engine.scheduler.max_num_batched_tokens,
    }
    print_table("engine (benchmarks.engine)", [(k, v) for k, v in results.items() if not isinstance(v, dict)])
    write_json(args.json, results)


if __name__ == "__main__":
    main()
