"""A Gated DeltaNet layer's recurrence and conv: native CPU kernels vs the torch reference.

Workload (a Qwen3.5-0.8B-like linear-attention layer; ``--heads`` / ``--head-dim`` change it):
  * 16 value heads (and 16 q/k heads), Dk = Dv = 128, conv over 2 * 16 * 128 + 16 * 128 = 6144
    channels with a kernel of 4; random fp32 inputs, q and k l2-normalised, state 0.1 * randn.
  * cases: ``prefill`` one sequence of 512 tokens (``--prefill``); ``decode`` 16 sequences of
    one token each (``--decode``).
  * kernels, same inputs: ``torch`` kernels/torch_cpu/gated_delta.py (the contract),
    ``native`` kernels/cpu/gated_delta.py with the same signature (allocates the final
    states), ``native_in_place`` the same with ``final_state=state`` (no [S, Hv, Dk, Dv]
    allocation), ``native_fused`` the fused entry (l2 norm, q scale, g and beta inside; raw
    inputs); from a state pool 4x the batch: ``native_gather`` ``pool[slots]`` then the
    kernel (a fresh result), ``native_slots`` ``state_slots=slots`` (read in the pool, a fresh
    result), ``native_slots_in_place`` also ``final_state=pool``. Conv: ``torch`` vs
    ``native``.
  * timing: samples alternate between the kernels (the machine is shared; drift hits them
    all), the median of ``--repeats`` after one warm-up each; wall time,
    ``torch.get_num_threads()`` threads (``--threads``).

Reported: tokens/s per kernel and case, native over torch, the max abs difference of each
native result from the reference, load averages, and the CPU (``lscpu`` model and flags).

    python -m benchmarks.gated_delta --json out/gated_delta.json
"""

from __future__ import annotations

import os
import statistics
import subprocess
import time
from collections.abc import Callable

import torch

from benchmarks.common import base_parser, print_table, write_json
from prefixgate.kernels.cpu.gated_delta import (
    causal_conv1d_varlen_native,
    gated_delta_rule_fused_native,
    gated_delta_rule_varlen_native,
    prepare_inputs_torch,
)
from prefixgate.kernels.torch_cpu.gated_delta import causal_conv1d_varlen, gated_delta_rule_varlen

CONV_KERNEL = 4


def lscpu() -> dict[str, str]:
    """lscpu's model name and flags ("unknown" without lscpu)."""
    try:
        text = subprocess.run(["lscpu"], capture_output=True, text=True, check=True).stdout
    except (OSError, subprocess.CalledProcessError):
        return {"model": "unknown", "flags": "unknown"}
    fields = dict(line.split(":", 1) for line in text.splitlines() if ":" in line)
    return {"model": fields.get("Model name", "unknown").strip(),
            "flags": fields.get("Flags", "unknown").strip()}


def _case(tokens_per_seq: int, seqs: int, heads: int, head_dim: int, seed: int) -> dict:
    gen = torch.Generator().manual_seed(seed)
    total = tokens_per_seq * seqs
    raw_q = torch.randn(total, heads, head_dim, generator=gen)
    raw_k = torch.randn(total, heads, head_dim, generator=gen)
    a, b = torch.randn(total, heads, generator=gen), torch.randn(total, heads, generator=gen)
    a_log, dt_bias = torch.randn(heads, generator=gen), torch.randn(heads, generator=gen)
    q, k, g, beta = prepare_inputs_torch(raw_q, raw_k, a, b, a_log, dt_bias, heads)
    channels = 3 * heads * head_dim
    return {
        "qsl": list(range(0, total + 1, tokens_per_seq)),
        "rule": (q, k, torch.randn(total, heads, head_dim, generator=gen), g, beta),
        "raw": (raw_q, raw_k, a, b, a_log, dt_bias),
        "state": torch.randn(seqs, heads, head_dim, head_dim, generator=gen) * 0.1,
        "conv": (torch.randn(total, channels, generator=gen),
                 torch.randn(channels, CONV_KERNEL, generator=gen),
                 torch.randn(seqs, CONV_KERNEL - 1, channels, generator=gen)),
        "tokens": total,
    }


def _kernels(case: dict) -> dict[str, Callable[[], object]]:
    qsl, state, (q, k, v, g, beta) = case["qsl"], case["state"], case["rule"]
    raw_q, raw_k, a, b, a_log, dt_bias = case["raw"]
    carried = state.clone()  # the in-place kernel's state (its values drift: timing only)
    # a state pool 4x the batch, the batch's entries scattered in it (as a runner's slots)
    pool = torch.cat([state, torch.zeros(3 * state.shape[0], *state.shape[1:])])
    slots = list(range(0, pool.shape[0], 4))[::-1]
    pool[slots] = state
    return {
        "rule torch": lambda: gated_delta_rule_varlen(q, k, v, g, beta, state, qsl),
        "rule native": lambda: gated_delta_rule_varlen_native(q, k, v, g, beta, state, qsl),
        "rule native_in_place": lambda: gated_delta_rule_varlen_native(
            q, k, v, g, beta, carried, qsl, final_state=carried),
        "rule native_fused": lambda: gated_delta_rule_fused_native(
            raw_q, raw_k, v, a, b, a_log, dt_bias, state, qsl),
        "rule native_gather": lambda: gated_delta_rule_varlen_native(
            q, k, v, g, beta, pool[slots], qsl),
        "rule native_slots": lambda: gated_delta_rule_varlen_native(
            q, k, v, g, beta, pool, qsl, state_slots=slots),
        "rule native_slots_in_place": lambda: gated_delta_rule_varlen_native(
            q, k, v, g, beta, pool, qsl, state_slots=slots, final_state=pool),
        "conv torch": lambda: causal_conv1d_varlen(*case["conv"], qsl),
        "conv native": lambda: causal_conv1d_varlen_native(*case["conv"], qsl),
    }


def _max_diff(expected: tuple, got: tuple | None) -> float:
    if got is None:
        raise SystemExit("the native CPU kernels are not available here (no C compiler?)")
    return max(float((e - a).abs().max()) for e, a in zip(expected, got, strict=True) if e.numel())


def main() -> None:
    parser = base_parser(__doc__.splitlines()[0])
    parser.add_argument("--heads", type=int, default=16)
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--prefill", type=int, default=512, help="tokens of the one sequence")
    parser.add_argument("--decode", type=int, default=16, help="sequences of one token")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--threads", type=int, default=None, help="torch threads")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    cpu = lscpu()
    results: dict[str, object] = {
        "cpu": cpu,
        "threads": torch.get_num_threads(),
        "workload": {"heads": args.heads, "head_dim": args.head_dim, "prefill": args.prefill,
                     "decode": args.decode, "repeats": args.repeats,
                     "conv_channels": 3 * args.heads * args.head_dim,
                     "conv_kernel": CONV_KERNEL},
        "load_before": os.getloadavg()[0],
    }
    table: list[tuple[str, object]] = [("threads", results["threads"])]
    cases = {"prefill": (args.prefill, 1), "decode": (1, args.decode)}
    with torch.inference_mode():
        for name, (tokens_per_seq, seqs) in cases.items():
            case = _case(tokens_per_seq, seqs, args.heads, args.head_dim, args.seed)
            qsl, state = case["qsl"], case["state"]
            rule_ref = gated_delta_rule_varlen(*case["rule"], state, qsl)
            conv_ref = causal_conv1d_varlen(*case["conv"], qsl)
            diffs = {
                "rule native": _max_diff(rule_ref, gated_delta_rule_varlen_native(
                    *case["rule"], state, qsl)),
                "rule native_fused": _max_diff(rule_ref, gated_delta_rule_fused_native(
                    *case["raw"][:2], case["rule"][2], *case["raw"][2:], state, qsl)),
                "conv native": _max_diff(conv_ref, causal_conv1d_varlen_native(
                    *case["conv"], qsl)),
            }  # fmt: skip
            kernels = _kernels(case)
            for fn in kernels.values():
                fn()
            samples: dict[str, list[float]] = {kernel: [] for kernel in kernels}
            for _ in range(args.repeats):
                for kernel, fn in kernels.items():
                    started = time.perf_counter()
                    fn()
                    samples[kernel].append(time.perf_counter() - started)
            per_case: dict[str, object] = {"tokens": case["tokens"]}
            for kernel, times in samples.items():
                seconds = statistics.median(times)
                per_case[f"{kernel} tokens_per_s"] = case["tokens"] / seconds
                per_case[f"{kernel} ms"] = seconds * 1e3
                table.append((f"{name}: {kernel} tokens/s (ms)",
                              f"{case['tokens'] / seconds:,.0f} ({seconds * 1e3:.2f})"))
            rule_kernels = ("native", "native_in_place", "native_fused", "native_gather",
                            "native_slots", "native_slots_in_place")
            for op, kernels_of_op in (("rule", rule_kernels),
                                      ("conv", ("native",))):
                for kernel in kernels_of_op:
                    speedup = per_case[f"{op} {kernel} tokens_per_s"] / per_case[
                        f"{op} torch tokens_per_s"]
                    per_case[f"{op} {kernel} over torch"] = speedup
                    table.append((f"{name}: {op} {kernel} / torch", f"{speedup:.1f}x"))
            for kernel, diff in diffs.items():
                per_case[f"{kernel} max_abs_diff"] = diff
                table.append((f"{name}: {kernel} max |native - torch|", f"{diff:.1e}"))
            results[name] = per_case
    results["load_after"] = os.getloadavg()[0]
    table.append(("load average before | after",
                  f"{results['load_before']:.1f} | {results['load_after']:.1f}"))
    print_table(f"gated delta layer, Hv {args.heads}, Dk = Dv {args.head_dim}, fp32", table)
    print(f"\nlscpu model: {cpu['model']}\nlscpu flags: {cpu['flags']}")
    write_json(args.json, results)


if __name__ == "__main__":
    main()
