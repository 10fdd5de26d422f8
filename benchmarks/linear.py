"""The linear layers of one decode step: fp32 vs quantized kernels, same weights, one run.

Workload (defaults; ``--rows`` and ``--model`` change it):
  * the 121 matrices of one step of the default SmolLM2-135M-Instruct Q4_1 GGUF, each its own
    weights, as the runner fuses them: per layer (30) q|k|v [960, 576], o [576, 576],
    gate|up [3072, 576], down [576, 1536] (Q4_1), then the tied LM head [49152, 576] (Q8_0);
    ~134 M weights, 96 MB of blocks or 540 MB of fp32.
  * rows M = 1, 8, 16, 32, 64 (the decode batch); the input of each matrix is random fp32.
  * kernels, each over the same values: ``fp32`` kernels/cpu/csrc/linear.c on the weights
    dequantized to fp32 (the fp32 runner's path), ``quant`` linear_quant.c (vector registers up
    to 16 rows, fp32 scratch tiles above), ``amx`` linear_amx.c (AMX-BF16 tiles, the
    activations split into three bf16 parts; only where :func:`quant_amx_available`).
  * threads: ``torch.get_num_threads()`` (``--threads``).
  * timing: one sample = all 121 matrices once; samples of the kernels alternate (the machine
    is shared; drift hits all of them), medians of ``--repeats`` after one warm-up each; wall
    time, or with ``--clock cpu`` the process's CPU time (with ``--threads 1`` it leaves out
    the time other jobs hold the core; with more threads it counts OpenMP's spinning).
  * peaks, same process: fp32 and bf16 ``torch.mm`` at 2048^3 (oneDNN; bf16 runs on AMX where
    the CPU has it): what a large GEMM reaches here, against which the GFLOPS are read.

Reported: ms per step and GFLOPS per kernel and row count, ``fp32_over_amx`` /
``quant_over_amx`` / ``fp32_over_quant`` (> 1: the second is faster), the max error of each
kernel against an fp64 product on the first layer's matrices (relative to sum |x| |w|), and the
load average before and after (other jobs on the machine skew everything).

    python -m benchmarks.linear --json out/linear.json
    python -m benchmarks.linear --rows 1 2 4 8 16 --repeats 9
"""

from __future__ import annotations

import os
import statistics
import time
from collections.abc import Callable

import torch

from benchmarks.common import base_parser, print_table, write_json
from prefixgate.engine.loader import load_model
from prefixgate.kernels.cpu.ops import (
    linear_native,
    linear_quant_native,
    pack_linear_weight,
    pack_quant_weight,
    quant_amx_available,
)
from prefixgate.kernels.quant import QuantizedTensor, cat_rows

PEAK_SIZE = 2048


def decode_matrices(weights: dict) -> list[QuantizedTensor]:
    """The step's matrices in the runner's order and fusion (q|k|v, o, gate|up, down; LM head)."""
    layers = sorted({int(name.split(".")[2]) for name in weights if ".layers." in name})
    out = []
    for i in layers:
        attn, mlp = f"model.layers.{i}.self_attn.", f"model.layers.{i}.mlp."
        out.append(cat_rows([weights[attn + f"{n}_proj.weight"] for n in "qkv"]))
        out.append(weights[attn + "o_proj.weight"])
        out.append(cat_rows([weights[mlp + "gate_proj.weight"], weights[mlp + "up_proj.weight"]]))
        out.append(weights[mlp + "down_proj.weight"])
    out.append(weights.get("lm_head.weight", weights["model.embed_tokens.weight"]))
    if not all(isinstance(w, QuantizedTensor) for w in out):
        raise SystemExit("benchmarks.linear needs a GGUF model with Q4_0/Q4_1/Q8_0 matrices")
    return out


CLOCKS = {"wall": time.perf_counter, "cpu": time.process_time}
_clock = time.perf_counter


def _step(calls: list[Callable[[], object]]) -> float:
    start = _clock()
    for call in calls:
        call()
    return _clock() - start


def _gemm_gflops(dtype: torch.dtype, repeats: int) -> float:
    a = torch.randn(PEAK_SIZE, PEAK_SIZE).to(dtype)
    b = torch.randn(PEAK_SIZE, PEAK_SIZE).to(dtype)
    torch.mm(a, b)
    seconds = min(_step([lambda: torch.mm(a, b)]) for _ in range(repeats))
    return 2 * PEAK_SIZE**3 / seconds / 1e9


def _max_error(out: torch.Tensor, x: torch.Tensor, weight: torch.Tensor) -> float:
    """max |out - x W^T| / (|x| |W|^T), the exact product in fp64."""
    exact = x.double() @ weight.double().T
    scale = x.double().abs() @ weight.double().abs().T
    return ((out.double() - exact).abs() / scale.clamp_min(1e-300)).max().item()


def main() -> None:
    parser = base_parser(__doc__.splitlines()[0])
    parser.add_argument("--model", default=None, help="GGUF file (default: SmolLM2)")
    parser.add_argument("--threads", type=int, default=None, help="torch threads")
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 8, 16, 32, 64])
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--clock", choices=sorted(CLOCKS), default="wall",
        help="cpu: this process's CPU seconds (with --threads 1, robust to other jobs' load)",
    )
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    global _clock
    _clock = CLOCKS[args.clock]
    load_before = os.getloadavg()

    matrices = decode_matrices(load_model(args.model).weights)
    quant = [pack_quant_weight(w) for w in matrices]
    fp32 = [pack_linear_weight(w.dequantize()) for w in matrices]
    if any(p is None for p in (*quant, *fp32)):
        raise SystemExit("the native CPU kernels are not available here (no compiler/AVX-512)")
    amx = quant_amx_available()
    weights = sum(w.shape[0] * w.shape[1] for w in matrices)
    generator = torch.Generator().manual_seed(args.seed)
    inputs = {w.shape[1]: torch.randn(max(args.rows), w.shape[1], generator=generator)
              for w in matrices}  # fmt: skip

    def kernels_for(rows: int) -> dict[str, list[Callable[[], object]]]:
        def x(w: QuantizedTensor) -> torch.Tensor:
            return inputs[w.shape[1]][:rows]

        out = {
            "fp32": [lambda w=w, p=p: linear_native(x(w), p, w.shape[0])
                     for w, p in zip(matrices, fp32, strict=True)],
            "quant": [lambda w=w, p=p: linear_quant_native(x(w), p, w.qtype, w.shape[0],
                                                           amx_min_rows=1 << 30)
                      for w, p in zip(matrices, quant, strict=True)],
        }  # fmt: skip
        if amx:
            out["amx"] = [lambda w=w, p=p: linear_quant_native(x(w), p, w.qtype, w.shape[0],
                                                               amx_min_rows=1)
                          for w, p in zip(matrices, quant, strict=True)]  # fmt: skip
        return out

    results: dict[str, object] = {
        "model": args.model or "SmolLM2-135M-Instruct (default)",
        "threads": torch.get_num_threads(),
        "amx": amx,
        "matrices": len(matrices),
        "weights": weights,
        "workload": {"rows": args.rows, "repeats": args.repeats, "clock": args.clock},
        "peak_gflops_fp32_gemm": _gemm_gflops(torch.float32, 5),
        "peak_gflops_bf16_gemm": _gemm_gflops(torch.bfloat16, 5),
    }
    table: list[tuple[str, object]] = [
        ("threads | AMX | clock", f"{results['threads']} | {amx} | {args.clock}"),
        ("torch.mm 2048^3 GFLOPS: fp32 | bf16",
         f"{results['peak_gflops_fp32_gemm']:.0f} | {results['peak_gflops_bf16_gemm']:.0f}"),
    ]  # fmt: skip

    # accuracy on the first layer's matrices and the LM head, 16 rows
    for name, calls in kernels_for(16).items():
        errors = []
        for i in (0, 1, 2, 3, len(matrices) - 1):
            w = matrices[i]
            errors.append(_max_error(calls[i](), inputs[w.shape[1]][:16], w.dequantize()))
        results[f"max_rel_error_{name}"] = max(errors)
        table.append((f"max error / sum|x||w| vs fp64, 16 rows: {name}", f"{max(errors):.2e}"))

    with torch.inference_mode():
        for rows in args.rows:
            fns = {name: (lambda c=calls: _step(c)) for name, calls in kernels_for(rows).items()}
            for fn in fns.values():
                fn()
            samples: dict[str, list[float]] = {name: [] for name in fns}
            for _ in range(args.repeats):
                for name, fn in fns.items():
                    samples[name].append(fn())
            seconds = {name: statistics.median(s) for name, s in samples.items()}
            shown = []
            for name, value in seconds.items():
                results[f"ms_{name}_m{rows}"] = value * 1e3
                results[f"gflops_{name}_m{rows}"] = 2 * rows * weights / value / 1e9
                shown.append(f"{name} {value * 1e3:6.1f}")
            results[f"fp32_over_quant_m{rows}"] = seconds["fp32"] / seconds["quant"]
            ratios = f"fp32/quant {seconds['fp32'] / seconds['quant']:.2f}"
            if amx:
                results[f"fp32_over_amx_m{rows}"] = seconds["fp32"] / seconds["amx"]
                results[f"quant_over_amx_m{rows}"] = seconds["quant"] / seconds["amx"]
                ratios += (f", fp32/amx {seconds['fp32'] / seconds['amx']:.2f}"
                           f", quant/amx {seconds['quant'] / seconds['amx']:.2f}")  # fmt: skip
            table.append((f"M={rows:3d} ms per step", " | ".join(shown) + f"  ({ratios})"))

    load_after = os.getloadavg()
    results["loadavg_before"], results["loadavg_after"] = load_before, load_after
    table.append(
        ("load average before | after (1 min)", f"{load_before[0]:.2f} | {load_after[0]:.2f}")
    )
    print_table("linear layers of one decode step (medians, alternating samples)", table)
    write_json(args.json, results)


if __name__ == "__main__":
    main()
