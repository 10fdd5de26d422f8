"""Long-prompt burst: Claude-Code-sized prompts arrive while streams decode; how much do the
running streams stall, and how soon do the new prompts start? prefixgate and a peer (vLLM
CPU) at the same KV memory, one after the other in one run (issue #25, the suite's part 4).

Workload (deterministic; defaults in brackets, --quick in braces):
  * --streams [16] {8} requests of --stream-tokens [256] {128} distinct token ids each
    (benchmarks.trace_workload's blocks: no prefix shared with anything), streamed from
    POST /v1/completions, temperature 0, ``ignore_eos``, max_tokens --stream-max-tokens [1024]:
    they decode through the whole run and are cancelled (the connection closed, so the server
    aborts them) once the burst has been answered.
  * Once every stream has produced --settle-tokens [12] {8} tokens, the burst: --burst [4] {2}
    prompts at once, distinct (no shared prefix: the worst case), their sizes spread evenly
    over --burst-min-tokens [6000] {3000} .. --burst-max-tokens [7000] {3500}, 16 output tokens
    each. NOTE: Claude Code's prompts are 12-16k tokens; the default model's context is 8,192,
    so they are scaled to ~6-7k (about 0.45x) to fit.
  * KV memory: --kv-memory [2] GiB on both servers (46,592 tokens of fp32 SmolLM2-135M: the
    streams and the burst fit at once; vLLM takes whole GiB).

Reported per server: the streams' inter-token latency (gaps between text chunks) p50/p90
before the burst (from the moment every stream has its first token to the burst's send) and
during it (gaps ending between the burst's send and its last response),
``itl_p90_burst_over_before`` (target <= 2),
the longest single stall during the burst, and the burst's TTFT p50 / max and its wall (send ->
last response). Ratios prefixgate / peer.

    python -m benchmarks.burst --peer vllm --json out/burst.json
    python -m benchmarks.burst --quick
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import time
from dataclasses import asdict, dataclass, field
from typing import Any

import httpx

from benchmarks.common import base_parser, ratio, write_json
from benchmarks.trace import (
    Servers,
    add_server_arguments,
    check_servers,
    print_report,
    servers_from_args,
    shown,
    with_peer,
    with_prefixgate,
)
from benchmarks.trace_workload import block_token_ids
from prefixgate.agents.report import percentile

BURST_OUTPUT_TOKENS = 16
DEFAULT_KV_MEMORY_GB = 2.0  # the streams and the burst fit at once
BLOCK = 64  # token ids are drawn in blocks of this many, one hash id each (all distinct)


@dataclass(frozen=True, slots=True)
class BurstWorkload:
    streams: int = 16
    stream_tokens: int = 256
    stream_max_tokens: int = 1024
    settle_tokens: int = 12
    burst: int = 4
    burst_min_tokens: int = 6000
    burst_max_tokens: int = 7000

    def __post_init__(self) -> None:
        if min(asdict(self).values()) < 1 or self.burst_min_tokens > self.burst_max_tokens:
            raise ValueError("every size must be >= 1 and burst_min_tokens <= burst_max_tokens")
        if self.stream_max_tokens <= self.settle_tokens:
            raise ValueError("stream_max_tokens must exceed settle_tokens")

    def burst_sizes(self) -> list[int]:
        if self.burst == 1:
            return [self.burst_max_tokens]
        step = (self.burst_max_tokens - self.burst_min_tokens) / (self.burst - 1)
        return [round(self.burst_min_tokens + i * step) for i in range(self.burst)]


QUICK = {"streams": 8, "stream_tokens": 128, "settle_tokens": 8, "burst": 2,
         "burst_min_tokens": 3000, "burst_max_tokens": 3500}


def distinct_prompt(index: int, tokens: int) -> list[int]:
    """``tokens`` token ids that share no block with any other prompt of the run."""
    ids: list[int] = []
    block = 0
    while len(ids) < tokens:
        ids.extend(block_token_ids(1_000_000 * (index + 1) + block, BLOCK, token_seed=7))
        block += 1
    return ids[:tokens]


@dataclass(slots=True)
class Stream:
    """Arrival times (perf_counter) of one request's text chunks, and its end."""

    chunks: list[float] = field(default_factory=list)
    sent: float = 0.0
    done: float | None = None
    error: str | None = None


async def stream(client: httpx.AsyncClient, model: str | None, prompt: list[int],
                 max_tokens: int, record: Stream, settled: asyncio.Event | None = None,
                 settle_tokens: int = 0) -> None:
    """Stream one completion into ``record``; sets ``settled`` at ``settle_tokens`` chunks
    (or when the stream ends first, so nobody waits on it)."""
    body: dict[str, Any] = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
                            "ignore_eos": True, "stream": True}
    if model is not None:
        body["model"] = model
    record.sent = time.perf_counter()
    try:
        async with client.stream("POST", "/v1/completions", json=body) as response:
            if response.status_code >= 400:
                raw = await response.aread()
                raise ValueError(f"HTTP {response.status_code}: {raw[:200].decode('utf-8', 'replace')}")
            async for line in response.aiter_lines():
                data = line[len("data:"):].strip() if line.startswith("data:") else ""
                if not data or data == "[DONE]":
                    continue
                if any(choice.get("text") for choice in json.loads(data).get("choices") or []):
                    record.chunks.append(time.perf_counter())
                    if settled is not None and len(record.chunks) >= settle_tokens:
                        settled.set()
    except (httpx.HTTPError, ValueError) as exc:
        record.error = f"{type(exc).__name__}: {exc}"
    finally:
        record.done = time.perf_counter()
        if settled is not None:
            settled.set()


async def _one_chunk_after(streams: list[Stream], moment: float, timeout_s: float) -> None:
    """Wait until every live stream has a chunk after ``moment``: the gap that spans the end
    of the burst is part of the burst's stall."""
    deadline = time.perf_counter() + timeout_s
    while time.perf_counter() < deadline and any(
            s.done is None and not (s.chunks and s.chunks[-1] > moment) for s in streams):
        await asyncio.sleep(0.01)


async def run_burst(base_url: str, model: str | None, workload: BurstWorkload,
                    timeout_s: float = 900.0) -> dict[str, Any]:
    """The streams, then the burst once they all decode; returns the figures."""
    limits = httpx.Limits(max_connections=workload.streams + workload.burst + 4)
    async with httpx.AsyncClient(base_url=base_url, limits=limits,
                                 timeout=httpx.Timeout(timeout_s)) as client:
        streams = [Stream() for _ in range(workload.streams)]
        settled = [asyncio.Event() for _ in streams]
        tasks = [asyncio.create_task(stream(client, model, distinct_prompt(i, workload.stream_tokens),
                                            workload.stream_max_tokens, record, event,
                                            workload.settle_tokens))
                 for i, (record, event) in enumerate(zip(streams, settled, strict=True))]
        await asyncio.gather(*(event.wait() for event in settled))
        burst = [Stream() for _ in workload.burst_sizes()]
        sent = time.perf_counter()
        await asyncio.gather(*(
            stream(client, model, distinct_prompt(workload.streams + i, size),
                   BURST_OUTPUT_TOKENS, record)
            for i, (size, record) in enumerate(zip(workload.burst_sizes(), burst, strict=True))))
        done = time.perf_counter()
        await _one_chunk_after(streams, done, timeout_s=60)
        for task in tasks:
            task.cancel()  # closing the connection aborts the request on the server
        await asyncio.gather(*tasks, return_exceptions=True)
    return burst_figures(streams, burst, sent, done)


def burst_figures(streams: list[Stream], burst: list[Stream], sent: float,
                  done: float) -> dict[str, Any]:
    """Stream ITL before / during the burst (gaps overlapping [sent, done]), burst TTFT."""
    before, during = [], []
    # NOTE: "before" starts once every stream decodes: while some streams still prefill, the
    # others' gaps measure the streams' own admission, not the steady decode the burst disturbs
    steady = max((r.chunks[0] for r in streams if r.chunks), default=sent)
    for record in streams:
        for start, end in zip(record.chunks[1:], record.chunks[2:], strict=False):
            if end <= sent and start >= steady:
                before.append(end - start)
            elif start < done:
                during.append(end - start)
    ttft = [r.chunks[0] - r.sent for r in burst if r.chunks and r.error is None]
    errors = [r.error for r in [*streams, *burst] if r.error is not None]
    figures = {
        "itl_before_p50_s": percentile(before, 50), "itl_before_p90_s": percentile(before, 90),
        "itl_burst_p50_s": percentile(during, 50), "itl_burst_p90_s": percentile(during, 90),
        "itl_burst_max_s": max(during, default=None),
        "itl_samples_before": len(before), "itl_samples_burst": len(during),
        "burst_ttft_p50_s": percentile(ttft, 50), "burst_ttft_max_s": max(ttft, default=None),
        "burst_wall_s": done - sent, "burst_ok": len(ttft), "errors": len(errors),
        "first_error": errors[0] if errors else None,
    }
    figures["itl_p90_burst_over_before"] = ratio(figures["itl_burst_p90_s"],
                                                 figures["itl_before_p90_s"])
    return figures


def run_server(name: str, base_url: str, model: str | None, workload: BurstWorkload,
               timeout_s: float) -> dict[str, Any]:
    """Warm up (one short request), then the streams and the burst."""
    loadavg = os.getloadavg()[0]
    print(f"[{name}] {workload.streams} streams, then a burst of {workload.burst} prompts "
          f"of {workload.burst_min_tokens}-{workload.burst_max_tokens} tokens ...", flush=True)
    warm = Stream()

    async def warm_up() -> None:
        async with httpx.AsyncClient(base_url=base_url, timeout=httpx.Timeout(300)) as client:
            await stream(client, model, list(range(500, 508)), 4, warm)

    asyncio.run(warm_up())
    figures = asyncio.run(run_burst(base_url, model, workload, timeout_s))
    figures.update(name=name, url=base_url, model=model, warmup_error=warm.error,
                   loadavg_1min_start=loadavg, loadavg_1min_end=os.getloadavg()[0])
    print(f"[{name}] burst answered in {figures['burst_wall_s']:.1f} s; stream ITL p90 "
          f"{shown(figures['itl_before_p90_s'])} s before, {shown(figures['itl_burst_p90_s'])} s "
          f"during", flush=True)
    return figures


ROWS = (("itl_before_p50_s", "stream ITL p50, no burst (s)"),
        ("itl_before_p90_s", "stream ITL p90, no burst (s)"),
        ("itl_burst_p50_s", "stream ITL p50, burst (s)"),
        ("itl_burst_p90_s", "stream ITL p90, burst (s)"),
        ("itl_p90_burst_over_before", "ITL p90 burst / no burst"),
        ("itl_burst_max_s", "longest stall in the burst (s)"),
        ("burst_ttft_p50_s", "burst TTFT p50 (s)"), ("burst_ttft_max_s", "burst TTFT max (s)"),
        ("burst_wall_s", "burst answered in (s)"), ("errors", "errors"),
        ("loadavg_1min_start", "load avg at start"))
RATIO_KEYS = ("itl_burst_p90_s", "itl_p90_burst_over_before", "burst_ttft_p50_s",
              "burst_ttft_max_s", "burst_wall_s")


def compare(workload: BurstWorkload, servers: Servers) -> dict[str, Any]:
    """prefixgate, then the peer if any; their figures and prefixgate / peer ratios."""
    def work(name: str, base_url: str, model: str | None) -> dict[str, Any]:
        return run_server(name, base_url, model, workload, servers.timeout_s)

    ours = with_prefixgate(servers, work)
    theirs = with_peer(servers, work) if servers.name_of_peer else None
    out: dict[str, Any] = {"peer": servers.name_of_peer}
    for key in RATIO_KEYS:
        out[key.removesuffix("_s") + "_ratio"] = (ratio(ours.get(key), theirs.get(key))
                                                  if theirs is not None else None)
    out["servers"] = {s["name"]: s for s in (ours, theirs) if s is not None}
    return out


def add_workload_arguments(parser: argparse.ArgumentParser) -> None:
    for name, value in asdict(BurstWorkload()).items():
        parser.add_argument("--" + name.replace("_", "-"), type=int, default=value)
    parser.add_argument("--quick", action="store_true", help="a small preset")


def workload_from_args(args: argparse.Namespace) -> BurstWorkload:
    """The flags' workload; --quick fills in what the flags left at their defaults."""
    values = {name: getattr(args, name) for name in asdict(BurstWorkload())}
    if args.quick:
        defaults = asdict(BurstWorkload())
        values.update({k: v for k, v in QUICK.items() if values[k] == defaults[k]})
    return BurstWorkload(**values)


def main(argv: list[str] | None = None) -> int:
    parser = base_parser(__doc__.splitlines()[0])
    add_workload_arguments(parser)
    add_server_arguments(parser, default_kv_memory=DEFAULT_KV_MEMORY_GB)
    args = parser.parse_args(argv)
    try:
        workload = workload_from_args(args)
    except ValueError as exc:
        parser.error(str(exc))
    servers = servers_from_args(args)
    problem = check_servers(servers)
    if problem:
        print(problem, file=sys.stderr)
        return 2
    results = {"workload": asdict(workload), "burst_sizes": workload.burst_sizes(),
               "kv_memory_gb": servers.kv_memory,
               "prefixgate_args": list(servers.prefixgate_args), **compare(workload, servers)}
    print_report(f"long-prompt burst: {workload.burst} prompts of {workload.burst_sizes()} tokens "
                 f"while {workload.streams} streams decode, KV {servers.kv_memory:g} GiB each "
                 "(benchmarks.burst)", list(results["servers"].values()), ROWS)
    print("\n" + "  ".join(f"{k}={shown(v)}" for k, v in results.items() if k.endswith("_ratio")))
    write_json(args.json, results)
    return 0 if all(not s["errors"] for s in results["servers"].values()) else 1


if __name__ == "__main__":
    sys.exit(main())
