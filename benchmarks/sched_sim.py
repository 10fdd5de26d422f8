"""Scheduling policy on a virtual clock: the real Scheduler and KVCacheManager, a cost model in
place of the model, so every arm sees the same traffic and no machine noise.

Why: on a shared 2-core box a real replay of one arm takes minutes and its timings move by 2x
with the load; the policy's effect (which tokens run in which step, which pages survive) is
deterministic and is what this measures. Real runs (benchmarks.sched_sweep, benchmarks.trace)
check the direction.

Cost model of one CPU step (SmolLM2-135M, fitted to the README's quiet-machine figures: decode
b1 ~12 ms, b16 ~40-50 ms, a 2,048-token prefill ~500-580 tok/s):
    step_s = STEP_BASE_S + STEP_UNIT_S * units + STEP_KV_READ_S * sum(chunk start positions)
where a decode row is 1 unit and a prefill chunk of n tokens from position s costs
n * (1 + (s + n / 2) / 3072) units (the scheduler's own context_scale cost). The last term is
what the units leave out: each prefill chunk streams its sequence's whole cached K/V once, so a
long prompt cut in small chunks re-reads its early K/V many times (fitted to the real burst:
8 decodes + ~28 prefill tokens at depth ~3,000 take ~4x a decode-only step, where the units
alone give ~3x). ``--kv-read-s 0`` gives the pure unit model.

``--cost-model concave`` charges a step's rows at falling marginal cost instead (fitted to
``benchmarks.model`` on the same machine: decode b1 ~12 ms, b16 ~44 ms, prefill 512 ~0.87 ms a
token): 10 ms + 2 ms a row up to 16 rows, 1.2 ms up to 64, 0.8 ms beyond, plus 1.2 ms per
attention unit (a unit beyond the rows) and the same K/V re-reads. It is the fairer model for
policies that change chunk sizes: a big chunk's GEMMs run nearer their peak.

Workloads:
  * ``trace``: the Mooncake FAST'25 synthetic trace (../shared/traces), sessions rebuilt from
    hash ids (a prompt extending an earlier one's blocks but its last continues that session),
    the first ``--sessions`` multi-turn sessions, each hash id a 16-token block, outputs scaled
    by 16/512 (at least 1), closed loop: a turn is sent its real gap x ``--time-scale`` after
    the previous one finished (the first turn at its timestamp x the same); the pool is 1,456 pages (23,296 tokens, the issue's 1 GiB) unless given.
  * ``replay``: ``benchmarks.trace``'s own replay at its defaults (178 requests of 48 sessions,
    at most 4 turns, each turn's prompt from the trace's hash ids), closed loop, same pool.
  * ``agents``: tool-pause sessions: 32 agents over a 1,000-token shared system prompt, 6
    turns, each adding a 200-token tool result, 48 output tokens, heavy-tailed pauses
    (lognormal, median 1 s), pool at 40% of the working set.
  * ``burst``: 16 streams decode 256 tokens; after their 24th token two 6,000-token prompts
    arrive: the streams' inter-token latency p90 during the burst over before it, and the
    long prompts' TTFT.
  * ``long``: one 16,000-token prompt alone (nothing decodes): its TTFT.
  * ``swarm``: 16 agents x 3 turns over a 2,000-token shared prompt, 32 output tokens, closed
    loop with no pauses (benchmarks.engine's shape).

Usage: ``python -m benchmarks.sched_sim [--json out.json] [--arms a,b] [--workloads w,x]``.
"""

from __future__ import annotations

import heapq
import json
import math
import random
import re
import statistics
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from benchmarks.common import base_parser, print_table, write_json
from benchmarks.trace_workload import (
    Scaling,
    Selection,
    build_replay,
    link_sessions,
    load_trace,
    select,
)
from prefixgate.cache import KVCacheManager
from prefixgate.engine.api import SamplingParams
from prefixgate.engine.scheduler import Scheduler
from prefixgate.engine.sequence import SeqStatus, Sequence
from prefixgate.engine.step_budget import settings_as_given

STEP_BASE_S, STEP_UNIT_S, CONTEXT_SCALE, PAGE = 0.012, 0.0015, 3072, 16
STEP_KV_READ_S = 0.000013
COST_MODELS = ("linear", "concave")


@dataclass(frozen=True)
class Costs:
    """How the virtual clock charges a step (module doc)."""

    kv_read_s: float = STEP_KV_READ_S
    model: str = "linear"
TRACE = Path(__file__).resolve().parents[2] / "shared" / "traces" / "mooncake_synthetic_trace.jsonl"
ARMS: dict[str, dict[str, Any]] = {
    # the old defaults: one 192 budget, no protection, arrival order
    "old": dict(max_num_batched_tokens=192, decode_step_budget=192, protect_waiting=False,
                admission_order="fcfs"),
    "fixed2048": dict(max_num_batched_tokens=2048, decode_step_budget=2048, protect_waiting=False,
                      admission_order="fcfs"),  # the workaround
    "adaptive": dict(max_num_batched_tokens=2048, decode_step_budget=192, protect_waiting=False,
                     admission_order="fcfs"),
    "protect": dict(max_num_batched_tokens=2048, decode_step_budget=192, admission_order="fcfs"),
    # today's: 512 / 64 while decoding, short prefills (<= 192 units) whole and first, lpm
    # (equal prefixes: least compute first)
    "default": dict(max_num_batched_tokens=512, decode_step_budget=64, short_prefill_budget=192),
    **{f"decode{b}": dict(max_num_batched_tokens=2048, decode_step_budget=b) for b in (32, 48, 64, 96, 128, 192, 256)},
    **{f"max{b}": dict(max_num_batched_tokens=b, decode_step_budget=64, short_prefill_budget=192)
       for b in (256, 1024, 2048, 4096)},
    "srpt": dict(max_num_batched_tokens=512, decode_step_budget=64, short_prefill_budget=192,
                 admission_order="srpt"),
    **{f"d{d}s{sh}": dict(max_num_batched_tokens=512, decode_step_budget=d, short_prefill_budget=sh)
       for d in (16, 32, 48, 64, 96) for sh in (128, 192, 256, 384, 512)},
    "unprotected": dict(max_num_batched_tokens=2048, decode_step_budget=192, protect_waiting=False),
    **{f"wait{w:g}s": dict(max_num_batched_tokens=512, decode_step_budget=64, short_prefill_budget=192,
                           max_admission_wait_s=w) for w in (1.0, 10.0, 20.0, 30.0, 60.0, 90.0, 120.0, 1e9)},
}


@dataclass
class Turn:
    new_tokens: list[int]  # appended to the session's history before this turn is sent
    max_tokens: int
    pause_s: float  # after the previous turn finished (the first turn: its start time)


@dataclass
class Session:
    turns: list[Turn]
    history: list[int] = field(default_factory=list)


def trace_sessions(limit: int, time_scale: float) -> list[Session]:
    """The first ``limit`` multi-turn sessions of the Mooncake trace (module doc)."""
    requests = [json.loads(line) for line in TRACE.open()]
    owner: dict[tuple[int, ...], int] = {}
    members: list[list[int]] = []
    for index, request in enumerate(requests):
        ids = tuple(request["hash_ids"])
        sid = next((owner[ids[:j]] for j in range(len(ids) - 1, 0, -1) if ids[:j] in owner), None)
        if sid is None:
            sid = len(members)
            members.append([])
        members[sid].append(index)
        owner[ids[:-1] or ids] = owner[ids] = sid
    sessions = []
    for chain in [m for m in members if len(m) > 1][:limit]:
        turns, sent = [], 0
        for k, index in enumerate(chain):
            request = requests[index]
            length = max(1, round(request["input_length"] * PAGE / 512))
            tokens = [h * PAGE + i for h in request["hash_ids"] for i in range(PAGE)][:length]
            gap = request["timestamp"] - (requests[chain[k - 1]]["timestamp"] if k else 0)
            turns.append(Turn(tokens[sent:] if k else tokens, max(1, round(request["output_length"] * PAGE / 512)),
                              gap / 1000 * time_scale))
            sent = len(tokens)
        sessions.append(Session(turns))
    return sessions


def agent_sessions(rng: random.Random) -> list[Session]:
    system = [rng.randrange(1 << 20) for _ in range(1000)]
    out = []
    for _ in range(32):
        turns = [Turn(system + [rng.randrange(1 << 20) for _ in range(60)], 48, rng.uniform(0, 4))]
        turns += [Turn([rng.randrange(1 << 20) for _ in range(200)], 48, rng.lognormvariate(0, 1))
                  for _ in range(5)]
        out.append(Session(turns))
    return out


def swarm_sessions(rng: random.Random) -> list[Session]:
    system = [rng.randrange(1 << 20) for _ in range(2000)]
    return [Session([Turn(system + [rng.randrange(1 << 20) for _ in range(60)], 32, 0.0)]
                    + [Turn([rng.randrange(1 << 20) for _ in range(40)], 32, 0.0) for _ in range(2)])
            for _ in range(16)]


class Sim:
    """Drives one Scheduler on a virtual clock; records per-request times."""

    def __init__(self, scheduler: Scheduler, costs: Costs = Costs()):
        self.s = scheduler
        self.kv_read_s = costs.kv_read_s
        self.concave = costs.model == "concave"
        self.now = 0.0
        scheduler.clock = lambda: self.now
        self.prefill = 0
        self.records: dict[str, dict[str, Any]] = {}

    def submit(self, rid: str, tokens: list[int], max_tokens: int, turn: int = 0) -> Sequence:
        seq = Sequence(request_id=rid, choice=0, token_ids=list(tokens), num_prompt_tokens=len(tokens),
                       sampling=SamplingParams(max_tokens=max_tokens), extra_keys=b"", tenant="t", agent=None)
        self.records[rid] = {"sent": self.now, "turn": turn, "tokens": [], "prompt": len(tokens)}
        self.s.add(seq)
        return seq

    def step_seconds(self, chunks: Any, units: float) -> float:
        """The step's compute under the chosen cost model (module doc), K/V re-reads aside."""
        if not self.concave:
            return STEP_BASE_S + STEP_UNIT_S * units
        rows = sum(c.num_tokens for c in chunks)
        linear = 0.010 + 0.002 * min(rows, 16) + 0.0012 * min(max(rows - 16, 0), 48) + 0.0008 * max(rows - 64, 0)
        return linear + 0.0012 * (units - rows)

    def step(self) -> list[Sequence]:
        """One step; returns the sequences that finished in it."""
        out = self.s.schedule()
        for seq in out.unschedulable:
            raise RuntimeError(f"{seq.request_id} can never fit the pool")
        units = sum(1 if c.seq.num_computed >= c.seq.num_prompt_tokens else self.s.costs.cost(c.start_pos, c.num_tokens)
                    for c in out.chunks)
        prefills = [c for c in out.chunks if c.seq.num_computed < c.seq.num_prompt_tokens]
        self.prefill += sum(c.num_tokens for c in prefills)
        self.now += self.step_seconds(out.chunks, units) + self.kv_read_s * sum(c.start_pos for c in prefills)
        self.s.commit(out)
        finished = []
        for c in out.chunks:
            seq = c.seq
            if not c.need_logits or seq.status is not SeqStatus.RUNNING:
                continue
            self.s.append_token(seq, 7 + len(seq.token_ids) % 13)
            record = self.records[seq.request_id]
            record["tokens"].append(self.now)
            if seq.num_output_tokens >= seq.sampling.max_tokens:
                record["cached"] = seq.num_cached_tokens or 0
                self.s.finish(seq)
                finished.append(seq)
        return finished


def run_sessions(arm: dict[str, Any], sessions: list[Session], num_pages: int,
                 costs: Costs = Costs()) -> dict[str, Any]:
    sim = Sim(scheduler_for(KVCacheManager(num_pages, PAGE), arm), costs)
    due = [(s.turns[0].pause_s, i, 0) for i, s in enumerate(sessions)]
    heapq.heapify(due)
    live = 0
    while due or live:
        while due and (due[0][0] <= sim.now or not live):
            at, i, k = heapq.heappop(due)
            sim.now = max(sim.now, at)
            session = sessions[i]
            session.history += session.turns[k].new_tokens
            sim.submit(f"s{i}t{k}", session.history, session.turns[k].max_tokens, k)
            live += 1
        for seq in sim.step():
            live -= 1
            i, k = (int(x) for x in seq.request_id[1:].split("t"))
            sessions[i].history = list(seq.token_ids)
            if k + 1 < len(sessions[i].turns):
                heapq.heappush(due, (sim.now + sessions[i].turns[k + 1].pause_s, i, k + 1))
    return summarise(sim)


def summarise(sim: Sim) -> dict[str, Any]:
    done = list(sim.records.values())
    ttft = [r["tokens"][0] - r["sent"] for r in done]
    returning = [r["tokens"][0] - r["sent"] for r in done if r["turn"] > 0]
    e2e = [r["tokens"][-1] - r["sent"] for r in done]
    itl = [b - a for r in done for a, b in zip(r["tokens"], r["tokens"][1:], strict=False)]
    stats = sim.s.cache.stats()
    return {"wall_s": sim.now, "e2e_p50_s": statistics.median(e2e), "e2e_sum_s": sum(e2e),
            "ttft_p50_s": statistics.median(ttft), "ttft_p90_s": pct(ttft, 0.9), "ttft_max_s": max(ttft),
            "returning_ttft_p90_s": pct(returning, 0.9), "itl_p90_s": pct(itl, 0.9),
            "hit_rate": sum(r["cached"] for r in done) / sum(r["prompt"] for r in done),
            "prefill_computed": sim.prefill, "preemptions": sim.s.num_preemptions,
            "protected_evicted": stats.protected_evicted}


def run_replay(arm: dict[str, Any], num_pages: int, costs: Costs = Costs()) -> dict[str, Any]:
    """benchmarks.trace's own replay at its defaults (the same 178 requests), closed loop: a
    first turn at its send time, a returning one its gap after its parent finished."""
    requests = load_trace(TRACE)
    links = link_sessions(requests)
    replay = build_replay(requests, links, select(requests, links, Selection()), Scaling())
    sim = Sim(scheduler_for(KVCacheManager(num_pages, PAGE), arm), costs)
    children: dict[int, list[Any]] = {}
    for r in replay:
        if r.parent is not None:
            children.setdefault(r.parent, []).append(r)
    due = [(r.at_s, r.id) for r in replay if r.parent is None]
    heapq.heapify(due)
    by_id = {r.id: r for r in replay}
    live = 0
    while due or live:
        while due and (due[0][0] <= sim.now or not live):
            at, rid = heapq.heappop(due)
            sim.now = max(sim.now, at)
            r = by_id[rid]
            sim.submit(f"s{r.session}t{r.turn}r{rid}", list(r.prompt), r.max_tokens, r.turn)
            live += 1
        for seq in sim.step():
            live -= 1
            rid = int(seq.request_id.rsplit("r", 1)[1])
            for child in children.get(rid, []):
                heapq.heappush(due, (sim.now + child.gap_s, child.id))
    return summarise(sim)


def run_burst(arm: dict[str, Any], rng: random.Random, costs: Costs = Costs()) -> dict[str, Any]:
    sim = Sim(scheduler_for(KVCacheManager(8192, PAGE), arm), costs)
    streams = [sim.submit(f"d{i}", [rng.randrange(1 << 20) for _ in range(64)], 256) for i in range(16)]
    burst_at = None
    longs: list[str] = []
    while sim.s.has_work():
        sim.step()
        if burst_at is None and min(s.num_output_tokens for s in streams) >= 24:
            burst_at = sim.now
            longs = [sim.submit(f"long{j}", [rng.randrange(1 << 20) for _ in range(6000)], 4).request_id
                     for j in range(2)]
    assert burst_at is not None
    end = max(sim.records[r]["tokens"][0] for r in longs)
    before, during = [], []
    for s in streams:
        times = sim.records[s.request_id]["tokens"]
        for a, b in zip(times, times[1:], strict=False):
            # NOTE: "before" from the 8th token on: the streams' own prefill steps are not ITL
            if b <= burst_at and a >= times[7]:
                before.append(b - a)
            elif a >= burst_at and b <= end:
                during.append(b - a)
    return {"itl_p90_before_s": pct(before, 0.9), "itl_p90_burst_s": pct(during, 0.9),
            "itl_ratio": pct(during, 0.9) / pct(before, 0.9), "long_ttft_s": end - burst_at}


def run_long(arm: dict[str, Any], rng: random.Random, costs: Costs = Costs()) -> dict[str, Any]:
    """One Claude-Code-sized prompt (16,000 tokens) alone: its TTFT (no stream decodes)."""
    sim = Sim(scheduler_for(KVCacheManager(8192, PAGE), arm), costs)
    sim.submit("long", [rng.randrange(1 << 20) for _ in range(16000)], 1)
    while sim.s.has_work():
        sim.step()
    return {"long_ttft_s": sim.records["long"]["tokens"][0], "steps": len(sim.records["long"]["tokens"])}


def pct(values: list[float], q: float) -> float:
    if not values:
        return math.nan
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def scheduler_for(cache: KVCacheManager, arm: dict[str, Any]) -> Scheduler:
    """The real Scheduler with an arm's settings (its budgets exactly as given)."""
    config, budgets = settings_as_given({"context_scale": CONTEXT_SCALE, **arm})
    return Scheduler(cache, config, budgets=budgets)


def arm_settings(name: str) -> dict[str, Any]:
    """A named arm, or ``d<decode>s<short>[m<max>]`` (e.g. d32s192m1024)."""
    if name in ARMS:
        return ARMS[name]
    match = re.fullmatch(r"d(\d+)s(\d+)(?:m(\d+))?", name)
    if match is None:
        raise SystemExit(f"unknown arm {name!r}")
    d, sh, top = (int(g) if g else None for g in match.groups())
    return dict(max_num_batched_tokens=top or 512, decode_step_budget=d, short_prefill_budget=sh)


def run(workload: str, arm: dict[str, Any], args: Any) -> dict[str, Any]:
    rng = random.Random(0)
    costs = Costs(args.kv_read_s, args.cost_model)
    if workload == "trace":
        return run_sessions(arm, trace_sessions(args.sessions, args.time_scale), args.trace_pages, costs)
    if workload == "replay":
        return run_replay(arm, args.trace_pages, costs)
    if workload == "agents":
        return run_sessions(arm, agent_sessions(rng), args.agent_pages, costs)
    if workload == "swarm":
        return run_sessions(arm, swarm_sessions(rng), 4096, costs)
    if workload == "long":
        return run_long(arm, rng, costs)
    return run_burst(arm, rng, costs)


def main() -> None:
    parser = base_parser(__doc__.splitlines()[0])
    parser.add_argument("--arms", default="old,fixed2048,adaptive,protect,default")
    parser.add_argument("--workloads", default="trace,agents,burst,swarm")
    parser.add_argument("--sessions", type=int, default=48)
    parser.add_argument("--trace-pages", type=int, default=1456)
    parser.add_argument("--time-scale", type=float, default=0.1, help="trace gaps x this")
    parser.add_argument("--agent-pages", type=int, default=1200)
    parser.add_argument("--cost-model", choices=COST_MODELS, default="linear")
    parser.add_argument("--kv-read-s", type=float, default=STEP_KV_READ_S,
                        help="seconds per cached token a prefill chunk re-reads (0: units only)")
    args = parser.parse_args()
    results: dict[str, dict[str, Any]] = {}
    for workload in args.workloads.split(","):
        for arm in args.arms.split(","):
            row = run(workload, arm_settings(arm), args)
            results.setdefault(workload, {})[arm] = row
            print(workload, arm, {k: round(v, 3) if isinstance(v, float) else v for k, v in row.items()},
                  flush=True)
    for workload, arms in results.items():
        print_table(workload, [(f"{arm}.{key}", f"{value:.4g}" if isinstance(value, float) else value)
                               for arm, row in arms.items() for key, value in row.items()])
    write_json(args.json, {"cost_model": {"step_base_s": STEP_BASE_S, "step_unit_s": STEP_UNIT_S,
                                          "kv_read_s": args.kv_read_s, "model": args.cost_model},
                           "arms": {a: arm_settings(a) for a in args.arms.split(",")}, "results": results})


if __name__ == "__main__":
    main()
