"""Prefill attention on CPU: the native paged kernel (kernels/cpu/csrc/paged_prefill.c) against
the torch path (the context gathered from the pages, then SDPA's CPU flash kernel), same pages,
same machine, samples alternating.

Shapes (SmolLM2-135M's heads by default: 9 query heads, 3 KV heads, head dim 64; pages of 16,
shuffled): a chunk of ``n`` new rows whose last row sits at position ``ctx - 1``:
  * 16 and 56 rows deep in a 3k context: the chunk that runs beside decodes;
  * 512 rows at 3k and 8k: a long prompt's chunks;
  * 16 rows deep in a 7k context.

Paths: ``native`` (the kernel's default: AMX-BF16 tiles where the CPU has them), ``native_fma``
(the same kernel with ``PREFIXGATE_PREFILL_AMX=0``: its AVX-512 FMA path, what a CPU without
AMX runs; timed only where AMX is there) and ``torch``. ``--kv bf16``: the pages in bf16 (the
``--dtype bf16`` mode's KV), else fp32.

Reported per shape: ms per layer and GFLOP/s (causal FLOPs: 4 x D per visible query-key pair and
head) of each, ``speedup`` = torch ms / native ms and ``amx_speedup`` = native_fma ms / native
ms; medians of ``--repeats`` alternating samples after a warm-up. ``--threads`` (default
torch's) for all.

    python -m benchmarks.prefill_attention --json out/prefill_attention.json
    python -m benchmarks.prefill_attention --kv bf16 --threads 1 --clock cpu
"""

from __future__ import annotations

import os
import statistics
import time

import torch

from benchmarks.common import base_parser, print_table, write_json
from benchmarks.step_profile import cpu_flags
from prefixgate.kernels.cpu.prefill import paged_prefill_native
from prefixgate.kernels.torch_cpu.attention import _prefill_one

SHAPES = ((16, 3016), (56, 3056), (512, 3072), (512, 8192), (16, 7016))


def _case(n: int, ctx: int, hq: int, hkv: int, d: int, page_size: int, gen: torch.Generator):
    used = -(-ctx // page_size)
    k_cache = torch.randn(used + 4, page_size, hkv, d, generator=gen)
    v_cache = torch.randn(used + 4, page_size, hkv, d, generator=gen)
    pages = torch.randperm(used + 4, generator=gen)[:used]
    query = torch.randn(n, hq, d, generator=gen)
    return query, k_cache, v_cache, pages


def _flops(n: int, ctx: int, hq: int, d: int) -> int:
    visible = sum(ctx - n + i + 1 for i in range(n))
    return 4 * d * hq * visible


AMX_FLAG = "PREFIXGATE_PREFILL_AMX"
# wall time, or with --clock cpu the process's CPU time (with --threads 1: what a loaded machine
# can still measure, leaving out the time other jobs hold the core)
CLOCKS = {"wall": time.perf_counter, "cpu": time.process_time}


def _native(out, query, k_cache, v_cache, pages, ctx, scale, amx: str):
    def run() -> None:
        os.environ[AMX_FLAG] = amx
        try:
            assert paged_prefill_native(out, query, k_cache, v_cache, pages, ctx, scale)
        finally:
            os.environ.pop(AMX_FLAG, None)

    return run


def _time_shape(n: int, ctx: int, heads: tuple[int, int, int], repeats: int,
                gen: torch.Generator, kv: str, clock=time.perf_counter) -> dict:
    hq, hkv, d = heads
    query, k_cache, v_cache, pages = _case(n, ctx, hq, hkv, d, 16, gen)
    if kv == "bf16":
        k_cache, v_cache = k_cache.bfloat16(), v_cache.bfloat16()
    out = torch.empty_like(query)
    scale = d**-0.5

    def torch_path() -> None:
        _prefill_one(query, k_cache, v_cache, pages.int(), ctx, scale)

    paths = {"native": _native(out, query, k_cache, v_cache, pages, ctx, scale, "1")}
    if "amx_bf16" in cpu_flags():
        paths["native_fma"] = _native(out, query, k_cache, v_cache, pages, ctx, scale, "0")
    paths["torch"] = torch_path
    times: dict[str, list[float]] = {name: [] for name in paths}
    for _ in range(repeats + 1):  # the first round warms up
        for name, fn in paths.items():
            start = clock()
            fn()
            times[name].append(clock() - start)
    flops = _flops(n, ctx, hq, d)
    row: dict = {"rows": n, "context": ctx, "flops": flops}
    for name, samples in times.items():
        seconds = statistics.median(samples[1:])
        row[f"{name}_ms"] = round(seconds * 1e3, 3)
        row[f"{name}_gflops"] = round(flops / seconds / 1e9, 1)
    row["speedup"] = round(row["torch_ms"] / row["native_ms"], 2)
    if "native_fma_ms" in row:
        row["amx_speedup"] = round(row["native_fma_ms"] / row["native_ms"], 2)
    return row


def measure(shapes, heads: tuple[int, int, int], repeats: int, kv: str = "fp32",
            clock: str = "wall") -> list[dict]:
    """One row per (rows, context) shape: each path's median ms and GFLOP/s, the speedups."""
    gen = torch.Generator().manual_seed(0)
    return [_time_shape(n, ctx, heads, repeats, gen, kv, CLOCKS[clock]) for n, ctx in shapes]


def main() -> None:
    parser = base_parser(__doc__)
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--heads", type=int, nargs=3, default=(9, 3, 64), metavar=("HQ", "HKV", "D"))
    parser.add_argument("--kv", choices=["fp32", "bf16"], default="fp32", help="the pages' dtype")
    parser.add_argument("--clock", choices=list(CLOCKS), default="wall")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    load = os.getloadavg()[0]
    rows = measure(SHAPES, tuple(args.heads), args.repeats, args.kv, args.clock)
    for row in rows:
        print_table(f"{row['rows']} rows, context {row['context']}",
                    [(k, v) for k, v in row.items() if k not in ("rows", "context", "flops")])
    write_json(args.json, {"threads": torch.get_num_threads(), "heads": list(args.heads),
                           "kv": args.kv, "clock": args.clock, "load_avg_before": load, "load_avg_after":
                           os.getloadavg()[0], "cpu_flags": cpu_flags(), "shapes": rows})


if __name__ == "__main__":
    main()
