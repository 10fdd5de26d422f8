"""Where each millisecond of an engine step goes, per precision mode (issue 38).

Workloads (defaults; sizes are flags), each on an ``LLMEngine`` of the default model (SmolLM2-135M
Q4_1 GGUF, CPU) built per mode (``--modes``: fp32 = the default, exact; bf16; q8):
  * ``decode_b1`` / ``decode_b16``: 1 / 16 greedy requests over ``--context`` 512-token prompts
    (prefilled beforehand, so the timed steps only decode), ``--steps`` tokens each, ignore_eos;
  * ``decode_b16_grammar``: the same 16 rows constrained by a regex (``[a-z ,.]+``, compiled
    before the timed run): what the token masks cost;
  * ``prefill_2k``: one cold ``--prefill`` 2,048-token prompt (random ordinary ids, a new one per
    sample) in one chunk, ``max_tokens`` 1.

Two passes per (mode, workload), one after the other:
  1. timing: the wall time of every ``LLMEngine.step``; the steady steps' median (decode: every
     row decoding, the first two steps dropped; prefill: the prompt's step);
  2. attribution: the same workload again under ``py-spy record --native --idle`` attached to this
     process (``--rate`` Hz, the main thread's stacks inside ``LLMEngine.step`` only). Each sample
     is charged to one category by its stack (:func:`category`):
       - ``gemm``: our linear kernels (linear*.c) or a torch/oneDNN matmul;
       - ``attention``: paged_prefill/decode/cascade.c or torch SDPA;
       - ``native_ops``: our per-token ops (cpu_ops.c: RMSNorm, SiLU, RoPE, KV writes);
       - ``sampling``: anything under engine/sampler.py;
       - ``grammar``: under engine/grammar, step_masks.py, xgrammar or the bitmask kernel;
       - ``torch_ops``: other torch kernels (adds, copies, gathers, argmax) called by the model;
       - ``dispatch``: calling into native code: the kernels' Python wrappers (kernels/*.py:
         argument checks, ctypes pointers), ctypes/libffi, torch's argument parsing, dispatcher
         and tensor wrapping (c10, at::_ops, THPVariable), tensor allocation;
       - ``python``: the interpreter running the engine's and the model's Python (gateway/: the
         forward's per-layer code, the runner's batch building, the scheduler, output handling);
       - ``omp_wait``: the main thread waiting at an OpenMP barrier outside any kernel (rare).
     ms per category = its share of the samples x the step median of pass 1.

The native library is compiled without debug info, so a C kernel's inlined helpers show as the
exported entry point or its OpenMP region (``pg_linear_q8._omp_fn.0``): named by the entry point.
Sampling costs ~5-15% in a blocking py-spy: shares, not times, come from pass 2.

    python -m benchmarks.step_profile --json out/step_profile.json
    python -m benchmarks.step_profile --modes fp32 --workloads decode_b1 --rate 250
"""

from __future__ import annotations

import os
import random
import re
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections import Counter
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch

from benchmarks.common import base_parser, print_table, write_json
from prefixgate.engine.api import GenerationRequest, GrammarSpec, SamplingParams
from prefixgate.engine.build import create_llm_engine
from prefixgate.engine.config import EngineConfig
from prefixgate.engine.engine_core import LLMEngine
from prefixgate.engine.loader import LoadedModel, load_model

WORKLOADS = ("decode_b1", "decode_b16", "decode_b16_grammar", "prefill_2k")
MODES = ("fp32", "bf16", "q8")
CATEGORIES = ("python", "dispatch", "gemm", "attention", "native_ops", "torch_ops", "sampling",
              "grammar", "omp_wait")
FIRST_ORDINARY_TOKEN = 100
PAGE_SIZE = 16
GRAMMAR = GrammarSpec("regex", "[a-z ,.]+")
FIGURE_FLAGS = ("avx512f", "avx512bw", "avx512_vnni", "avx512_bf16", "avx512_fp16", "amx_tile",
                "amx_bf16", "amx_int8")


@dataclass(frozen=True, slots=True)
class Settings:
    context: int = 512
    steps: int = 64
    prefill: int = 2048
    prefill_samples: int = 4
    rate: int = 200


# ---------------------------------------------------------------------------- classification

# our C kernels by exported entry point (kernels/cpu/csrc)
_OURS = (
    ("gemm", re.compile(r"pg_linear|linear_(amx|bf16|q8|quant)|pg_q8_rows|pg_quant_rows|amx_")),
    ("attention", re.compile(r"pg_paged|pg_cascade|paged_(prefill|decode)|cascade_")),
    # the whole-step decode's own loop (decode_step.c) is charged with the small ops it drives
    ("native_ops", re.compile(r"pg_rms|pg_silu|pg_rope|pg_write_kv|pg_gated|pg_causal|"
                              r"pg_dense_decode_step")),
    ("grammar", re.compile(r"pg_apply_token_bitmask")),
)
_TORCH_GEMM = re.compile(r"gemm|dnnl|mkldnn|brgemm|at::native::(addmm|mm|bmm|linear)|_mkl_|mkl_")
_TORCH_ATTN = re.compile(r"scaled_dot_product|flash_attention|sdpa")
_DISPATCH = re.compile(r"ffi_call|_ctypes|PyCFuncPtr|c10::|at::_ops|THPVariable|pybind11|torch::Python|"
                       r"torch::autograd|TensorImpl|Dispatcher|Allocator|at::empty|malloc|free\b")
_GOMP = re.compile(r"gomp_|GOMP_")


def _frame_file(frame: str) -> str:
    match = re.search(r"\(([^():]+)(?::\d+)?\)\s*$", frame)
    return match.group(1) if match else ""


def category(frames: list[str]) -> str:
    """The category of one sampled stack (root first), as the module docstring lists them."""
    files = [_frame_file(f) for f in frames]
    if any("engine/sampler" in f for f in files):
        return "sampling"
    if any(s in f for f in files for s in ("engine/grammar", "step_masks", "xgrammar")):
        return "grammar"
    last_py = max((i for i, f in enumerate(files) if f.endswith(".py")), default=-1)
    native = frames[last_py + 1:]  # the native frames below the innermost Python frame
    for frame in reversed(native):
        for name, pattern in _OURS:
            if pattern.search(frame):
                return name
    text = " ".join(native)
    if _TORCH_GEMM.search(text):
        return "gemm"
    if _TORCH_ATTN.search(text):
        return "attention"
    if any("at::native" in f or "at::vec" in f or "at::internal" in f for f in native):
        return "torch_ops"
    if native and _GOMP.search(native[-1]):
        return "omp_wait"
    if _DISPATCH.search(text) or (last_py >= 0 and files[last_py].startswith("kernels/")):
        return "dispatch"  # ctypes / torch's argument parsing, or a kernel's Python wrapper
    return "python"


def attribute(raw: str) -> Counter:
    """Samples per category of a py-spy ``--format raw`` file, main-thread stacks inside a step."""
    counts: Counter = Counter()
    for line in raw.splitlines():
        stack, _, count = line.rpartition(" ")
        if not stack or not count.isdigit():
            continue
        frames = stack.split(";")
        if not any(f.startswith("LLMEngine.step (") for f in frames):
            continue
        counts[category(frames)] += int(count)
    return counts


# ---------------------------------------------------------------------------- py-spy


class Spy:
    """``py-spy record`` attached to this process while the block runs (raw stacks)."""

    def __init__(self, rate: int) -> None:
        self.rate = rate
        self.raw = ""

    def __enter__(self) -> Spy:
        exe = shutil.which("py-spy") or str(Path(sys.executable).with_name("py-spy"))
        self.out = Path(tempfile.mkstemp(suffix=".txt", prefix="step_profile_")[1])
        self.proc = subprocess.Popen(
            [exe, "record", "--pid", str(os.getpid()), "--native", "--idle", "--threads",
             "--rate", str(self.rate), "--format", "raw", "-o", str(self.out)],
            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        time.sleep(2.0)  # attach before the workload starts (samples outside a step are dropped)
        return self

    def __exit__(self, *exc: object) -> None:
        self.proc.send_signal(signal.SIGINT)
        _, err = self.proc.communicate(timeout=120)
        self.raw = self.out.read_text() if self.out.exists() else ""
        self.out.unlink(missing_ok=True)
        if not self.raw:
            raise RuntimeError(f"py-spy wrote nothing: {err.decode(errors='replace')[-400:]}")


def spy_available() -> bool:
    return bool(shutil.which("py-spy") or Path(sys.executable).with_name("py-spy").exists())


# ---------------------------------------------------------------------------- workloads


def _ids(rng: random.Random, vocab: int, count: int) -> tuple[int, ...]:
    return tuple(rng.randrange(FIRST_ORDINARY_TOKEN, vocab) for _ in range(count))


def new_engine(loaded: LoadedModel, mode: str, settings: Settings) -> LLMEngine:
    per_seq = -(-(settings.context + settings.steps * 8) // PAGE_SIZE) + 1
    pages = max(16 * per_seq, 2 * -(-settings.prefill // PAGE_SIZE)) * 2 + 64
    config = EngineConfig(num_pages=pages, page_size=PAGE_SIZE, device="cpu", dtype=mode,
                          max_num_batched_tokens=max(2048, settings.prefill),
                          num_speculative_tokens=0, max_num_seqs=64)
    return create_llm_engine(config, loaded=loaded)[0]


def _timed_steps(engine: LLMEngine, requests: list[GenerationRequest]) -> list[float]:
    for request in requests:
        engine.add_request(request, lambda item: None)
    times = []
    while engine.has_work():
        began = time.perf_counter()
        engine.step()
        times.append(time.perf_counter() - began)
    return times


class Workloads:
    """The requests of each workload for one engine; prompts of the decodes cached once."""

    def __init__(self, engine: LLMEngine, vocab: int, settings: Settings) -> None:
        self.engine, self.vocab, self.settings = engine, vocab, settings
        self.rng = random.Random(0)
        self.prompts = [_ids(self.rng, vocab, settings.context) for _ in range(16)]
        self.serial = 0
        _timed_steps(engine, self._decodes(16, 1, None))  # cache the prompts
        _timed_steps(engine, self._decodes(16, 2, GRAMMAR))  # compile the grammar

    def _decodes(self, batch: int, tokens: int, grammar: GrammarSpec | None) -> list[GenerationRequest]:
        self.serial += 1
        sampling = SamplingParams(max_tokens=tokens, temperature=0.0, ignore_eos=True)
        return [GenerationRequest(p, sampling, request_id=f"r{self.serial}-{i}", grammar=grammar)
                for i, p in enumerate(self.prompts[:batch])]

    def run(self, name: str) -> list[float]:
        """Seconds of each steady step of one run of workload ``name``."""
        if name == "prefill_2k":
            out = []
            for _ in range(self.settings.prefill_samples):
                prompt = _ids(self.rng, self.vocab, self.settings.prefill)
                sampling = SamplingParams(max_tokens=1, temperature=0.0)
                self.serial += 1
                out += _timed_steps(self.engine, [GenerationRequest(
                    prompt, sampling, request_id=f"p{self.serial}")])[:1]
            return out
        batch = 1 if name == "decode_b1" else 16
        grammar = GRAMMAR if name.endswith("grammar") else None
        return _timed_steps(self.engine, self._decodes(batch, self.settings.steps, grammar))[2:]


# ---------------------------------------------------------------------------- driver


def profile_mode(loaded: LoadedModel, mode: str, workloads: list[str], settings: Settings,
                 log) -> dict[str, Any]:
    engine = new_engine(loaded, mode, settings)
    runs = Workloads(engine, loaded.config.vocab_size, settings)
    out: dict[str, Any] = {}
    for name in workloads:
        runs.run(name)  # warm-up
        steps = runs.run(name)
        step_ms = statistics.median(steps) * 1e3
        row: dict[str, Any] = {"step_ms": round(step_ms, 3), "steps_timed": len(steps),
                               "load_avg": os.getloadavg()[0]}
        if spy_available():
            with Spy(settings.rate) as spy:
                runs.run(name)
            counts = attribute(spy.raw)
            total = sum(counts.values()) or 1
            row["samples"] = total
            for cat in CATEGORIES:
                row[f"{cat}_pct"] = round(100 * counts[cat] / total, 1)
                row[f"{cat}_ms"] = round(step_ms * counts[cat] / total, 3)
            row["python_dispatch_pct"] = round(row["python_pct"] + row["dispatch_pct"], 1)
        log(f"{mode} {name}: {row}")
        out[name] = row
    return out


def cpu_flags() -> list[str]:
    text = Path("/proc/cpuinfo").read_text() if Path("/proc/cpuinfo").exists() else ""
    flags = next((line.split(":", 1)[1].split() for line in text.splitlines()
                  if line.startswith("flags")), [])
    return [f for f in FIGURE_FLAGS if f in flags]


def _git_commit() -> str:
    """The commit of the tree the profiled package comes from (a worktree's, when it is one)."""
    import prefixgate.gateway

    tree = Path(next(iter(prefixgate.gateway.__path__))).parent
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True,
                              text=True, check=True, cwd=tree).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def table(results: dict[str, Any]) -> list[tuple[str, Any]]:
    rows = []
    for mode, per in results["modes"].items():
        for name, row in per.items():
            parts = " ".join(f"{c}={row.get(c + '_ms', 0):.1f}" for c in CATEGORIES
                             if row.get(c + "_ms"))
            rows.append((f"{mode:5} {name}", f"{row['step_ms']:8.1f} ms | {parts}"))
    return rows


def main() -> None:
    parser = base_parser(__doc__.splitlines()[0])
    for field, value in asdict(Settings()).items():
        parser.add_argument("--" + field.replace("_", "-"), type=type(value), default=value)
    parser.add_argument("--modes", nargs="+", choices=MODES, default=list(MODES))
    parser.add_argument("--workloads", nargs="+", choices=WORKLOADS, default=list(WORKLOADS))
    parser.add_argument("--threads", type=int, default=None)
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    settings = Settings(**{k: getattr(args, k) for k in asdict(Settings())})
    if not spy_available():
        print("py-spy not found (pip install py-spy): step times only")
    loaded = load_model(None)
    results: dict[str, Any] = {
        "settings": asdict(settings), "commit": _git_commit(), "cpu_flags": cpu_flags(),
        "threads": torch.get_num_threads(), "load_avg_before": list(os.getloadavg()), "modes": {}}
    for mode in args.modes:
        results["modes"][mode] = profile_mode(loaded, mode, args.workloads, settings, print)
    results["load_avg_after"] = list(os.getloadavg())
    print_table(f"ms per step by category ({results['threads']} threads, {results['commit']})",
                table(results))
    write_json(args.json, results)


if __name__ == "__main__":
    main()
