"""Prefill attention on CPU: the native paged kernel (kernels/cpu/csrc/paged_prefill.c) against
the torch path (the context gathered from the pages, then SDPA's CPU flash kernel), same pages,
same machine, samples alternating.

Shapes (SmolLM2-135M's heads by default: 9 query heads, 3 KV heads, head dim 64; pages of 16,
shuffled): a chunk of ``n`` new rows whose last row sits at position ``ctx - 1``:
  * 16 and 56 rows deep in a 3k context: the chunk that runs beside decodes;
  * 512 rows at 3k and 8k: a long prompt's chunks;
  * 16 rows deep in a 7k context.

Reported per shape: ms per layer and GFLOP/s (causal FLOPs: 4 x D per visible query-key pair and
head) of both, and ``speedup`` = torch ms / native ms; medians of ``--repeats`` alternating
samples after a warm-up. ``--threads`` (default torch's) for both.

    python -m benchmarks.prefill_attention --json out/prefill_attention.json
"""

from __future__ import annotations

import statistics
import time

import torch

from benchmarks.common import base_parser, print_table, write_json
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


def _time_shape(n: int, ctx: int, heads: tuple[int, int, int], repeats: int,
                gen: torch.Generator) -> dict:
    hq, hkv, d = heads
    query, k_cache, v_cache, pages = _case(n, ctx, hq, hkv, d, 16, gen)
    out = torch.empty_like(query)
    scale = d**-0.5

    def native() -> None:
        assert paged_prefill_native(out, query, k_cache, v_cache, pages, ctx, scale)

    def torch_path() -> None:
        _prefill_one(query, k_cache, v_cache, pages.int(), ctx, scale)

    times: dict[str, list[float]] = {"native": [], "torch": []}
    for _ in range(repeats + 1):  # the first pair warms up
        for name, fn in (("native", native), ("torch", torch_path)):
            start = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - start)
    flops = _flops(n, ctx, hq, d)
    row: dict = {"rows": n, "context": ctx, "flops": flops}
    for name, samples in times.items():
        seconds = statistics.median(samples[1:])
        row[f"{name}_ms"] = round(seconds * 1e3, 3)
        row[f"{name}_gflops"] = round(flops / seconds / 1e9, 1)
    row["speedup"] = round(row["torch_ms"] / row["native_ms"], 2)
    return row


def measure(shapes, heads: tuple[int, int, int], repeats: int) -> list[dict]:
    """One row per (rows, context) shape: both paths' median ms and GFLOP/s, and the speedup."""
    gen = torch.Generator().manual_seed(0)
    return [_time_shape(n, ctx, heads, repeats, gen) for n, ctx in shapes]


def main() -> None:
    parser = base_parser(__doc__)
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--heads", type=int, nargs=3, default=(9, 3, 64), metavar=("HQ", "HKV", "D"))
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    rows = measure(SHAPES, tuple(args.heads), args.repeats)
    for row in rows:
        print_table(f"{row['rows']} rows, context {row['context']}",
                    [(k, v) for k, v in row.items() if k not in ("rows", "context", "flops")])
    write_json(args.json, {"threads": torch.get_num_threads(), "heads": list(args.heads),
                           "shapes": rows})


if __name__ == "__main__":
    main()
