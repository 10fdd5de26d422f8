"""The whole-step native decode (kernels/cpu/decode_step.py) against the per-op path, same
runner, same weights, alternating samples.

Workload (defaults; every size is a flag): the default model (SmolLM2-135M-Instruct GGUF),
per ``--modes`` (fp32 = the default exact mode with the GGUF blocks weight-only; bf16; q8),
``--batches`` 1 and 16 sequences, each over a private copy of one ``--context`` 512-token
prefilled context; a sample is ``--steps`` 32 greedy decode steps through
``ModelRunner.execute`` (the runner's input building included: what a step costs). Samples of
the two paths alternate on the one runner (its ``model.decode_step`` set or cleared), medians
of ``--repeats`` after a warm-up of each; the machine is shared, so compare the ratio.

Reported per mode and batch: tokens/s of each path and ``speedup`` = per-op seconds / native
seconds; whether both paths chose the same greedy tokens (they are bit-identical by test);
the thread count, load average and the CPU's bf16/int8 instructions.

    python -m benchmarks.decode_step --json out/decode_step.json
    python -m benchmarks.decode_step --modes q8 --batches 1 --threads 1 2
"""

from __future__ import annotations

import os
import statistics

import torch

from benchmarks.common import base_parser, print_table, write_json
from benchmarks.model import FIRST_ORDINARY_TOKEN, _OurDecode
from prefixgate.engine.loader import load_model
from prefixgate.engine.runner import ModelRunner, SeqChunk
from prefixgate.kernels.cpu.library import bf16_instructions, int8_instructions

PAGE_SIZE = 16


def _sample(runner: ModelRunner, native_step, native: bool, batch: int, context: int,
            capacity: int, first: int, steps: int) -> tuple[float, list[int]]:
    runner.model.decode_step = native_step if native else None
    decode = _OurDecode(runner, batch, context, capacity, first)
    seconds = decode.run(steps)
    return seconds, decode.tokens


def run_mode(loaded, mode: str, args) -> list[dict]:
    capacity = args.context + args.steps + 2
    pages_per_seq = -(-capacity // PAGE_SIZE)
    runner = ModelRunner.from_loaded(loaded, num_pages=max(args.batches) * pages_per_seq,
                                     page_size=PAGE_SIZE, device="cpu", dtype=mode)
    native_step = runner.model.decode_step
    if native_step is None:
        return [{"mode": mode, "skipped": "the native step does not bind here"}]
    gen = torch.Generator().manual_seed(0)
    prompt = torch.randint(FIRST_ORDINARY_TOKEN, loaded.config.vocab_size, (args.context,),
                           generator=gen).tolist()
    runner.execute([SeqChunk(prompt, 0, list(range(pages_per_seq)), True)])
    first = prompt[-1]
    results = []
    for batch in args.batches:
        times: dict[bool, list[float]] = {True: [], False: []}
        tokens: dict[bool, list[int]] = {}
        for repeat in range(args.repeats + 1):
            order = (True, False) if repeat % 2 == 0 else (False, True)
            for native in order:
                seconds, chosen = _sample(runner, native_step, native, batch, args.context,
                                          capacity, first, args.steps)
                tokens[native] = chosen
                if repeat:  # the first round warms both up
                    times[native].append(seconds)
        runner.model.decode_step = native_step
        native_s, per_op_s = statistics.median(times[True]), statistics.median(times[False])
        results.append({
            "mode": mode, "batch": batch,
            "native_tok_s": round(batch * args.steps / native_s, 1),
            "per_op_tok_s": round(batch * args.steps / per_op_s, 1),
            "native_ms_per_step": round(1000 * native_s / args.steps, 3),
            "per_op_ms_per_step": round(1000 * per_op_s / args.steps, 3),
            "speedup": round(per_op_s / native_s, 3),
            "same_tokens": tokens[True] == tokens[False],
        })
    return results


def main() -> None:
    parser = base_parser(__doc__)
    parser.add_argument("--model", default=None, help="GGUF path (default: the bundled model)")
    parser.add_argument("--modes", nargs="+", default=["fp32", "bf16", "q8"],
                        choices=["fp32", "bf16", "q8"])
    parser.add_argument("--batches", nargs="+", type=int, default=[1, 16])
    parser.add_argument("--context", type=int, default=512)
    parser.add_argument("--steps", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--threads", type=int, nargs="+", default=[0],
                        help="torch threads per run (0: torch's own choice)")
    args = parser.parse_args()
    loaded = load_model(args.model) if args.model else load_model()
    rows, results = [], []
    load_before = os.getloadavg()[0]
    for threads in args.threads:
        if threads:
            torch.set_num_threads(threads)
        for mode in args.modes:
            if (mode == "bf16" and not bf16_instructions()) or (
                    mode == "q8" and not int8_instructions()):
                continue
            for entry in run_mode(loaded, mode, args):
                entry["threads"] = torch.get_num_threads()
                results.append(entry)
                if "skipped" in entry:
                    rows.append((f"{mode}", entry["skipped"]))
                    continue
                rows.append((f"{mode} b{entry['batch']} t{entry['threads']} native / per-op "
                             "tok/s", f"{entry['native_tok_s']} / {entry['per_op_tok_s']} "
                             f"({entry['speedup']}x, same tokens: {entry['same_tokens']})"))
    summary = {"results": results, "load_before": load_before, "load_after": os.getloadavg()[0],
               "bf16_instructions": bf16_instructions(), "int8_instructions": int8_instructions()}
    print_table("whole-step native decode vs per-op", rows)
    write_json(args.json, summary)


if __name__ == "__main__":
    main()
