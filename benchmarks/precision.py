"""Speed of the CPU precision modes against the fp32 path, same weights, one run.

Workload (defaults; every size is a flag):
  * model: the default SmolLM2-135M-Instruct Q4_1 GGUF (``--model`` for another), CPU; one runner
    per mode over the same loaded weights: ``fp32`` (today's default: exact, GGUF blocks run in
    their blocks, fp32 KV) and every mode of ``--modes``: ``bf16`` (``--dtype bf16``: bf16
    matrices, fp32 activations, bf16 KV), ``q8`` (``--dtype q8``: the GGUF blocks x int8
    activations, fp32 KV), ``q8:bf16`` (the same with the bf16 KV); with ``--dense-baseline``
    also ``fp32-dense`` (blocks dequantized to fp32: the path an fp32 / bf16 safetensors model
    takes).
  * prefill: one sequence of ``--prefill`` random ordinary token ids (2,048), empty cache, one
    ``execute`` (K/V into pages, the last token's logits).
  * decode: batch ``--batches`` (1, 16), every sequence a private copy of one prefilled
    ``--context`` (512) context (benchmarks.model's harness); one sample = ``--steps`` greedy
    steps.
  * timing (wall, or ``--clock cpu``: the process's CPU time): samples alternate mode by mode (the machine is shared: drift hits all), ``--repeats``
    rounds after a warm-up; reported: tokens/s medians per mode and the median of the per-round
    ratios ``fp32 seconds / mode seconds`` (> 1: the mode is faster), which drift between rounds
    does not move.
  * peak: bf16 and fp32 ``torch.mm`` at 2,048^3 (oneDNN; bf16 on AMX where present) and the
    native bf16 linear at 2,048 x 2,048 x 2,048, in the same process; the fraction of the
    bf16 peak the mode's prefill sustains counts only its linear layers' FLOPs (2 x rows x
    weights; the LM head for the last row only) over the whole prefill's time.

    python -m benchmarks.precision --json out/precision.json
    python -m benchmarks.precision --modes q8 bf16 --threads 1 --clock cpu
    python -m benchmarks.precision --batches 1 16 --prefill 2048 --dense-baseline --repeats 5
"""

from __future__ import annotations

import dataclasses
import statistics
import time
from collections.abc import Callable

import torch

from benchmarks.common import base_parser, print_table, write_json
from benchmarks.model import _OurDecode
from prefixgate.engine.loader import LoadedModel, load_model
from prefixgate.engine.model_config import ModelConfig
from prefixgate.engine.runner import ModelRunner, SeqChunk
from prefixgate.kernels.cpu.library import _cpu_flags, bf16_instructions, int8_instructions
from prefixgate.kernels.cpu.ops import linear_bf16_native, pack_bf16_weight
from prefixgate.kernels.quant import QuantizedTensor

FIRST_ORDINARY_TOKEN = 100
PAGE_SIZE = 16
PEAK_SIZE = 2048


def layer_weights(config: ModelConfig) -> int:
    """Weights of one decoder layer's matrices (q|k|v, o, gate|up, down)."""
    hidden, inter = config.hidden_size, config.intermediate_size
    return (hidden * (config.q_size + 2 * config.kv_size) + config.q_size * hidden
            + 3 * hidden * inter)


def prefill_linear_flops(config: ModelConfig, tokens: int) -> float:
    """FLOPs of a prefill's linear layers (the LM head for the last token only)."""
    return 2.0 * (tokens * config.num_layers * layer_weights(config)
                  + config.vocab_size * config.hidden_size)


def peaks(repeats: int) -> dict[str, float]:
    """GFLOPS of a 2,048^3 GEMM: torch fp32, torch bf16 (oneDNN), the native bf16 linear."""
    a, b = torch.randn(PEAK_SIZE, PEAK_SIZE), torch.randn(PEAK_SIZE, PEAK_SIZE)
    ab, bb = a.bfloat16(), b.bfloat16()
    packed = pack_bf16_weight(b)
    fns: dict[str, Callable[[], object]] = {
        "fp32_mm": lambda: torch.mm(a, b), "bf16_mm": lambda: torch.mm(ab, bb),
    }
    if packed is not None:
        fns["bf16_native"] = lambda: linear_bf16_native(a, packed, PEAK_SIZE)
    seconds = alternating({name: _timer(fn) for name, fn in fns.items()}, repeats)
    return {name: 2 * PEAK_SIZE**3 / statistics.median(s) / 1e9 for name, s in seconds.items()}


# wall time, or with --clock cpu the process's CPU time (with --threads 1 it leaves out the
# time other jobs hold the core: the figure a loaded machine can still give)
CLOCKS = {"wall": time.perf_counter, "cpu": time.process_time}
clock = CLOCKS["wall"]


def _timer(fn: Callable[[], object]) -> Callable[[], float]:
    def timed() -> float:
        start = clock()
        fn()
        return clock() - start

    return timed


def alternating(fns: dict[str, Callable[[], float]], repeats: int) -> dict[str, list[float]]:
    """One warm-up each, then ``repeats`` rounds of one sample each; seconds per sample."""
    for fn in fns.values():
        fn()
    samples: dict[str, list[float]] = {name: [] for name in fns}
    for _ in range(repeats):
        for name, fn in fns.items():
            samples[name].append(fn())
    return samples


# the modes compared with fp32 (--modes), each DTYPE[:KV]
MODES = ("bf16", "bf16:fp32", "q8", "q8:bf16")
# /proc/cpuinfo flags printed beside the figures
FIGURE_FLAGS = ("avx512f", "avx512bw", "avx512_vnni", "avx512_bf16", "amx_tile", "amx_bf16",
                "amx_int8", "avx512_fp16")


def build_runners(loaded: LoadedModel, pages: int, modes: list[str],
                  dense: bool) -> dict[str, ModelRunner]:
    def build(model: LoadedModel, mode: str) -> ModelRunner:
        dtype, _, kv = mode.partition(":")  # DTYPE[:KV], as benchmarks.fidelity takes them
        return ModelRunner.from_loaded(model, num_pages=pages, page_size=PAGE_SIZE,
                                       device="cpu", dtype=dtype, kv_dtype=kv or None)

    runners = {"fp32": build(loaded, "fp32")} | {mode: build(loaded, mode) for mode in modes}
    if dense:
        weights = {name: w.dequantize() if isinstance(w, QuantizedTensor) else w
                   for name, w in loaded.weights.items()}
        runners["fp32-dense"] = build(dataclasses.replace(loaded, weights=weights), "fp32")
    return runners


def summarize(name: str, tokens: int, samples: dict[str, list[float]]) -> dict[str, float]:
    """tokens/s medians per mode and the median per-round speedup over fp32."""
    out = {f"{name}_tok_s_{mode}": tokens / statistics.median(s) for mode, s in samples.items()}
    for mode, s in samples.items():
        if mode != "fp32":
            ratios = [base / mine for base, mine in zip(samples["fp32"], s, strict=True)]
            out[f"{name}_speedup_{mode}"] = statistics.median(ratios)
    return out


def measure(runners: dict[str, ModelRunner], ids: list[int], batches: list[int], context: int,
            steps: int, repeats: int) -> dict[str, float]:
    """Prefill of ``ids`` and decode of every batch size, modes alternating."""
    table = list(range(-(-len(ids) // PAGE_SIZE)))
    prefill = alternating({mode: _timer(lambda r=r: r.execute([SeqChunk(ids, 0, table, True)]))
                           for mode, r in runners.items()}, repeats)
    results = summarize(f"prefill_{len(ids)}", len(ids), prefill)
    capacity = context + steps * (repeats + 1) + 1
    prompt = ids[:context]
    firsts = {mode: int(r.execute([SeqChunk(prompt, 0, list(range(-(-capacity // PAGE_SIZE))),
                                            True)])[0].argmax()) for mode, r in runners.items()}
    for batch in batches:
        decodes = {mode: _OurDecode(r, batch, context, capacity, firsts[mode])
                   for mode, r in runners.items()}
        samples = alternating({mode: _timer(lambda d=d: d.run(steps))
                               for mode, d in decodes.items()}, repeats)
        results.update(summarize(f"decode_b{batch}", batch * steps, samples))
    return results


def prefill_rates(config: ModelConfig, tokens: int, modes: list[str], results: dict[str, float],
                  peak: dict[str, float]) -> dict[str, float]:
    """Per mode, the GFLOPS its prefill's linear layers sustained; bf16's fraction of the bf16
    GEMM peak; the peaks."""
    flops = prefill_linear_flops(config, tokens)
    out = {f"peak_gflops_{name}": value for name, value in peak.items()}
    for mode in modes:
        seconds = tokens / results[f"prefill_{tokens}_tok_s_{mode}"]
        out[f"prefill_{mode}_linear_gflops"] = flops / seconds / 1e9
    if "bf16" in modes:
        out["prefill_bf16_fraction_of_bf16_mm_peak"] = (
            out["prefill_bf16_linear_gflops"] / peak["bf16_mm"])
    return out


def main() -> None:
    parser = base_parser(__doc__.splitlines()[0])
    parser.add_argument("--model", default=None, help="GGUF file or HF directory (default model)")
    parser.add_argument("--prefill", type=int, default=2048)
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 16])
    parser.add_argument("--context", type=int, default=512)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--clock", choices=list(CLOCKS), default="wall")
    parser.add_argument("--modes", nargs="+", choices=MODES, default=["bf16"],
                        help="the modes timed against fp32")
    parser.add_argument("--dense-baseline", action="store_true",
                        help="also the fp32 runner over weights dequantized to fp32")
    args = parser.parse_args()
    global clock
    clock = CLOCKS[args.clock]
    if args.threads:
        torch.set_num_threads(args.threads)
    loaded = load_model(args.model)
    capacity = args.context + args.steps * (args.repeats + 1) + 1
    pages = max(max(args.batches) * -(-capacity // PAGE_SIZE), -(-args.prefill // PAGE_SIZE))
    runners = build_runners(loaded, pages, args.modes, args.dense_baseline)
    generator = torch.Generator().manual_seed(0)
    ids = torch.randint(FIRST_ORDINARY_TOKEN, loaded.config.vocab_size, (args.prefill,),
                        generator=generator).tolist()
    with torch.inference_mode():
        results = measure(runners, ids, args.batches, args.context, args.steps, args.repeats)
        peak = peaks(args.repeats)
    results.update(prefill_rates(loaded.config, args.prefill, args.modes, results, peak))
    print_table(f"precision modes vs fp32 ({torch.get_num_threads()} threads)",
                [(key, value) for key, value in sorted(results.items())])
    flags = [f for f in _cpu_flags().split() if f in FIGURE_FLAGS]
    write_json(args.json, {"model": loaded.name, "threads": torch.get_num_threads(),
                           "bf16_instructions": bf16_instructions(),
                           "int8_instructions": int8_instructions(), "cpu_flags": flags,
                           "workload": vars(args) | {"json": None}, **results})


if __name__ == "__main__":
    main()
