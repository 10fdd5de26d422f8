"""Scheduling settings swept over three workloads in one process (offline engine, default model).

Every arm is a fresh engine with the same weights and pool; only scheduling knobs differ
(docs/scheduling.md). The arms run one after the other, each workload in turn, so noise from
the machine lands on every arm alike; compare ratios, not seconds.

Workloads (token ids drawn from a seeded RNG: no tokenizer, prompts shared token for token):
  * ``swarm``: benchmarks.engine's agent swarm (16 agents x 3 turns over a ~2k-token shared
    system prompt, 32 output tokens, closed loop, no pauses): decode-heavy, every prompt hits.
  * ``pressure``: multi-turn sessions under memory pressure, shaped like a production trace:
    ``--sessions`` sessions share a 512-token system prompt, each turn adds 256-768 new tokens
    of its own (tool results, documents) and reads 16 output tokens, the next turn comes after
    a pause (exponential, mean ``--pause-s``), sessions start staggered. The pool holds about
    half of the working set, so prefixes are evicted while sessions pause and while requests wait.
  * ``burst``: 16 streams decode 192 tokens each; after their 24th token two 3,000-token
    prompts arrive. Reports the streams' inter-token latency p90 before and during the burst
    (the ratio the issue bounds at 2x) and the long prompts' TTFT.

Usage: ``python -m benchmarks.sched_sweep --json sweep.json [--arms old,adaptive,...]``.
"""

from __future__ import annotations

import random
import statistics
import time
from typing import Any

from benchmarks.common import base_parser, print_table, write_json
from benchmarks.engine import run_swarm
from prefixgate.engine.api import Delta, GenerationRequest, SamplingParams
from prefixgate.engine.build import create_llm_engine
from prefixgate.engine.config import EngineConfig
from prefixgate.engine.loader import load_model

# the old defaults (one 192 budget, no protection), the workaround, and the new parts
ARMS: dict[str, dict[str, Any]] = {
    "old": dict(max_num_batched_tokens=192, decode_step_budget=192, protect_waiting=False,
                admission_order="fcfs"),
    "fixed2048": dict(max_num_batched_tokens=2048, decode_step_budget=2048, protect_waiting=False,
                      admission_order="fcfs"),
    "adaptive": dict(max_num_batched_tokens=2048, decode_step_budget=192, protect_waiting=False,
                     admission_order="fcfs"),
    "protect": dict(admission_order="fcfs"),  # adaptive + protection
    "default": dict(),  # the engine's defaults: adaptive + protection + lpm
    "decode128": dict(decode_step_budget=128),
}
VOCAB = 40_000


def percentile(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def greedy(max_tokens: int) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)


def run_pressure(engine, sessions: int, turns: int, pause_s: float, seed: int = 0) -> dict[str, Any]:
    """Closed-loop sessions: turn n+1 is sent a pause after turn n's last token."""
    rng = random.Random(seed)
    system = [rng.randrange(VOCAB) for _ in range(512)]
    history = {s: list(system) for s in range(sessions)}
    due = [(rng.uniform(0, 2.0), s, 0) for s in range(sessions)]  # (send at, session, turn)
    live: dict[str, tuple[int, int, float, list[Delta]]] = {}
    records: list[dict[str, Any]] = []
    ttft: dict[str, float] = {}
    t0 = time.perf_counter()
    while due or live:
        now = time.perf_counter() - t0
        for entry in sorted(d for d in due if d[0] <= now):
            due.remove(entry)
            _, s, turn = entry
            history[s] += [rng.randrange(VOCAB) for _ in range(rng.randint(256, 768))]
            rid, out = f"s{s}t{turn}", []
            engine.add_request(GenerationRequest(tuple(history[s]), greedy(16), request_id=rid), out.append)
            live[rid] = (s, turn, time.perf_counter(), out)
        if not live:
            time.sleep(max(0.0, min(d[0] for d in due) - now))
            continue
        engine.step()
        for rid, (s, turn, sent, out) in list(live.items()):
            if out and rid not in ttft:
                ttft[rid] = time.perf_counter() - sent
            if out and out[-1].usage is not None:
                del live[rid]
                usage = out[-1].usage
                history[s] += [t for d in out for t in d.token_ids]
                records.append({"rid": rid, "turn": turn, "e2e_s": time.perf_counter() - sent,
                                "prompt": usage.prompt_tokens, "cached": usage.cached_tokens})
                if turn + 1 < turns:
                    due.append((time.perf_counter() - t0 + rng.expovariate(1 / pause_s), s, turn + 1))
    done = records
    returning = [ttft[r["rid"]] for r in done if r["turn"] > 0]
    return {"wall_s": time.perf_counter() - t0,
            "e2e_p50_s": statistics.median(r["e2e_s"] for r in done),
            "e2e_sum_s": sum(r["e2e_s"] for r in done),
            "ttft_p50_s": statistics.median(ttft.values()),
            "ttft_p90_s": percentile(list(ttft.values()), 0.9),
            "returning_ttft_p90_s": percentile(returning, 0.9),
            "hit_rate": sum(r["cached"] for r in done) / sum(r["prompt"] for r in done),
            "prefill_computed": engine.prefill_tokens_computed}


def run_burst(engine, seed: int = 0) -> dict[str, Any]:
    """16 decoding streams; two long prompts arrive after the streams' 24th token."""
    rng = random.Random(seed)
    streams: dict[str, list[float]] = {}
    for i in range(16):
        rid = f"d{i}"
        streams[rid] = []
        prompt = tuple(rng.randrange(VOCAB) for _ in range(64))
        engine.add_request(GenerationRequest(prompt, greedy(192), request_id=rid),
                           lambda d, rid=rid: streams[rid].append(time.perf_counter()))
    burst_at: float | None = None
    first: dict[str, float] = {}
    sent: dict[str, float] = {}
    while engine.has_work():
        engine.step()
        if burst_at is None and min(len(v) for v in streams.values()) >= 24:
            burst_at = time.perf_counter()
            for j in range(2):
                rid = f"long{j}"
                sent[rid] = time.perf_counter()
                prompt = tuple(rng.randrange(VOCAB) for _ in range(3000))
                engine.add_request(GenerationRequest(prompt, greedy(4), request_id=rid),
                                   lambda d, rid=rid: first.setdefault(rid, time.perf_counter()))
    assert burst_at is not None
    burst_end = max(first.values())
    before, during = [], []
    for times in streams.values():
        for a, b in zip(times, times[1:], strict=False):
            if b <= burst_at:
                before.append(b - a)
            elif a >= burst_at and b <= burst_end:
                during.append(b - a)
    return {"itl_p90_before_s": percentile(before, 0.9), "itl_p90_burst_s": percentile(during, 0.9),
            "itl_ratio": percentile(during, 0.9) / percentile(before, 0.9),
            "long_ttft_max_s": burst_end - burst_at}


def main() -> None:
    parser = base_parser(__doc__.splitlines()[0])
    parser.add_argument("--arms", default="old,fixed2048,adaptive,protect,default")
    parser.add_argument("--workloads", default="pressure,burst,swarm")
    parser.add_argument("--sessions", type=int, default=12)
    parser.add_argument("--turns", type=int, default=4)
    parser.add_argument("--pause-s", type=float, default=1.0)
    parser.add_argument("--num-pages", type=int, default=768, help="pool pages (16 tokens each) "
                        "for pressure; swarm and burst get 4096")
    args = parser.parse_args()
    longest = 512 + args.turns * (768 + 16)  # a session's last prompt at most
    if "pressure" in args.workloads and args.num_pages * 16 < longest:
        parser.error(f"--num-pages {args.num_pages} holds {args.num_pages * 16} tokens: a session "
                     f"can reach {longest}")
    loaded = load_model(None)
    results: dict[str, dict[str, Any]] = {}
    for workload in args.workloads.split(","):
        for arm in args.arms.split(","):
            pages = args.num_pages if workload == "pressure" else 4096
            engine, _ = create_llm_engine(EngineConfig(num_pages=pages, page_size=16, device="cpu",
                                                       **ARMS[arm]), loaded=loaded)
            if workload == "pressure":
                row = run_pressure(engine, args.sessions, args.turns, args.pause_s)
            elif workload == "burst":
                row = run_burst(engine)
            else:
                swarm = run_swarm(engine, loaded.tokenizer)
                ttfts = [r["ttft_s"] for a in swarm["agents"] for r in a.records]
                row = {"wall_s": swarm["wall_s"], "ttft_p50_s": statistics.median(ttfts),
                       "ttft_p90_s": percentile(ttfts, 0.9),
                       "prefill_computed": swarm["prefill_tokens_computed"]}
            row["protected_evicted"] = engine.scheduler.cache.stats().protected_evicted
            results.setdefault(workload, {})[arm] = row
            print(workload, arm, {k: round(v, 3) if isinstance(v, float) else v for k, v in row.items()},
                  flush=True)
    for workload, arms in results.items():
        print_table(workload, [(f"{arm}.{key}", f"{value:.3g}" if isinstance(value, float) else value)
                               for arm, row in arms.items() for key, value in row.items()])
    write_json(args.json, {"arms": {a: ARMS[a] for a in args.arms.split(",")}, "results": results})


if __name__ == "__main__":
    main()
