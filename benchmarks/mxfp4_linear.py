"""The MXFP4 linear kernel at gpt-oss-20b's expert shapes against the expanded fp32 reference.

Workload: one expert's matrices of gpt-oss-20b (hidden 2880, intermediate 2880): ``gate_up``
``[5760, 2880]`` and ``down`` ``[2880, 2880]``, random weights quantized to MXFP4
(kernels/torch_cpu/mxfp4.py), ``x [M, K]`` for ``--rows`` M (1: a decode step's token routed
to an expert alone; larger: tokens sharing an expert, a prefill chunk). Per M and matrix:
  * ``native``: kernels/cpu/csrc/linear_mxfp4.c on the blocks, its best path (and ``--paths``:
    every path this build has: avx512, avx2, c);
  * ``fp32``: the same values expanded to fp32 at load, ``torch.nn.functional.linear`` (the
    expanded reference: what loading the experts as fp32 would run, at 7.5x the memory);
  * ``torch reference``: kernels/torch_cpu/mxfp4.py, the blocks dequantized per call, then
    the fp32 GEMM (the fallback with the native library off).
Timing: ``--threads`` torch threads (default 1), the three run in turn, ``--repeats`` rounds,
medians of CPU time (``time.process_time``; a shared machine swings wall time by multiples).
Reported: microseconds per call and the native kernel's speed-up over each.

    python -m benchmarks.mxfp4_linear --json out/mxfp4_linear.json
    python -m benchmarks.mxfp4_linear --rows 1 4 --paths --repeats 20
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F

from benchmarks.common import base_parser, print_table, write_json
from prefixgate.kernels.cpu.mxfp4 import PATH_NAMES, linear_mxfp4, mxfp4_native_path
from prefixgate.kernels.torch_cpu.mxfp4 import linear_mxfp4_reference, quantize_mxfp4

SHAPES = {"gate_up": (5760, 2880), "down": (2880, 2880)}  # gpt-oss-20b, one expert


def _cpu_seconds(fn: Callable[[], object], calls: int) -> float:
    start = time.process_time()
    for _ in range(calls):
        fn()
    return (time.process_time() - start) / calls


def measure(out_features: int, cols: int, rows: int, args: Any) -> dict[str, float]:
    """Median CPU microseconds per call of each contender, run in turn every round."""
    gen = torch.Generator().manual_seed(args.seed)
    weight = quantize_mxfp4(torch.randn(out_features, cols, generator=gen) * 0.02)
    expanded = weight.dequantize()
    x = torch.randn(rows, cols, generator=gen)
    contenders: dict[str, Callable[[], object]] = {
        "native": lambda: linear_mxfp4(x, weight),
        "fp32": lambda: F.linear(x, expanded),
        "torch_reference": lambda: linear_mxfp4_reference(x, weight),
    }
    if args.paths:
        for path in range(1, (mxfp4_native_path() or 0) + 1):
            contenders[f"native_{PATH_NAMES[path]}"] = (
                lambda path=path: linear_mxfp4(x, weight, path=path))
    samples: dict[str, list[float]] = {name: [] for name in contenders}
    for fn in contenders.values():
        fn()  # warm-up
    for _ in range(args.repeats):
        for name, fn in contenders.items():
            samples[name].append(_cpu_seconds(fn, args.calls) * 1e6)
    result = {f"{name}_us": statistics.median(s) for name, s in samples.items()}
    result["mxfp4_bytes"], result["fp32_bytes"] = weight.nbytes, expanded.numel() * 4
    return result


def main() -> None:
    parser = base_parser(__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 4, 16, 64])
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--calls", type=int, default=5, help="calls per timed sample")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--paths", action="store_true", help="every native path too")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    if mxfp4_native_path() is None:
        raise SystemExit("the native CPU library is unavailable here")
    torch.set_num_threads(args.threads)
    results: dict[str, dict[str, float]] = {}
    rows: list[tuple[str, Any]] = []
    for matrix, (out_features, cols) in SHAPES.items():
        for m in args.rows:
            r = results[f"{matrix}_m{m}"] = measure(out_features, cols, m, args)
            extra = " ".join(f"{k.removesuffix('_us')} {v:.0f}" for k, v in r.items()
                             if k.startswith("native_"))  # fmt: skip
            rows.append((f"{matrix} [{out_features}x{cols}] M={m:<3} us: native | fp32 | torch ref",
                         f"{r['native_us']:.0f} | {r['fp32_us']:.0f} | "
                         f"{r['torch_reference_us']:.0f}  (native x{r['fp32_us'] / r['native_us']:.2f}"
                         f" vs fp32, x{r['torch_reference_us'] / r['native_us']:.1f} vs torch ref)"
                         + (f"  [{extra}]" if extra else "")))
    print_table(f"MXFP4 linear, gpt-oss-20b expert shapes, CPU, {args.threads} thread(s), "
                f"best path {PATH_NAMES[mxfp4_native_path() or 1]}", rows)
    write_json(args.json, {"args": {k: v for k, v in vars(args).items() if k != "json"},
                           "results": results})


if __name__ == "__main__":
    main()
