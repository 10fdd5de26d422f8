"""Model throughput: prefixgate's runner vs transformers, same machine, same weights, one run.

Workload (defaults; every size is a flag):
  * model: the default SmolLM2-135M-Instruct Q4_1 GGUF (``--model`` for another), dequantised
    to fp32 by both sides (transformers loads the same file with ``gguf_file=``), CPU.
  * threads: both sides run with the same ``torch.set_num_threads`` (``--threads``; default:
    torch's own choice for this machine).
  * prefill: one sequence of 512 and of 2048 random token ids (seeded, ordinary tokens),
    empty cache. Ours: one ``ModelRunner.execute`` with one chunk (K/V written into pages,
    logits of the last token). transformers: one forward with ``use_cache=True`` and
    ``logits_to_keep=1`` (it builds its KV cache and computes only the last logits too).
  * decode: batch 1, 8, 16, 32; every sequence has a 512-token context (the prompt above,
    prefilled once, then COPIED so each sequence owns distinct memory: our pages via
    ``kernels.copy_pages``, transformers' DynamicCache via ``batch_repeat_interleave``). One
    sample = ``--steps`` greedy steps (argmax fed back); transformers runs its plain forward
    with the cache (leaner than ``generate``: no logits processors), all rows the same length
    so no padding is needed.
  * timing: samples of ours and transformers alternate (the machine is shared; drift hits
    both), medians of ``--repeats`` samples after one warm-up each.

  * ``--fp32-baseline``: also a second runner of ours over the same weights dequantized to fp32
    (the path before the quantized kernel, kernels/cpu/csrc/linear.c), its samples alternating with
    the quantized runner's; ``--no-transformers`` leaves transformers out (a quick A/B).
  * ``--kv-dtype bf16``: our runner's KV pool in bf16 (default auto: the model's fp32);
    ``--kv-baseline``: also a runner over the same weights with the model-dtype (fp32) pool,
    alternating with it, so ``kv_speedup_*`` = fp32-pool seconds / ``--kv-dtype`` seconds.
  * memory: the process RSS once our runner is built, less the loaded weights it was built
    from (``rss_mb_ours``, before transformers loads), and what the fp32 runner adds to it.

Reported: tokens/s per workload for both, ``prefill_ratio_<N>`` and ``decode_ratio_b<B>`` =
ours / transformers (> 1: prefixgate is faster), ``quant_speedup_*`` = quantized / fp32 runner,
``kv_speedup_*`` = ``--kv-dtype`` pool / fp32 pool,
plus the kernel backend, whether the native CPU decode kernel ran, and the thread count.

    python -m benchmarks.model --json out/model.json
    python -m benchmarks.model --fp32-baseline --no-transformers --batches 1 16 --prefill 2048
    python -m benchmarks.model --kv-dtype bf16 --kv-baseline --no-transformers --batches 16
"""

from __future__ import annotations

import copy
import dataclasses
import gc
import statistics
import time
from collections.abc import Callable
from pathlib import Path

import torch

from benchmarks.common import base_parser, print_table, write_json
from prefixgate import kernels
from prefixgate.engine.loader import load_model
from prefixgate.engine.runner import ChunkState, ModelRunner, SeqChunk
from prefixgate.kernels.quant import QuantizedTensor

FIRST_ORDINARY_TOKEN = 100  # skip the special tokens at the start of the vocabulary


def _alternating_medians(
    fns: dict[str, Callable[[], float]], repeats: int
) -> dict[str, float]:
    """Run warm-up once each, then alternate samples; each callable returns seconds."""
    for fn in fns.values():
        fn()
    samples: dict[str, list[float]] = {name: [] for name in fns}
    for _ in range(repeats):
        for name, fn in fns.items():
            samples[name].append(fn())
    return {name: statistics.median(values) for name, values in samples.items()}


def _rss_mb() -> float:
    """Resident set size of this process (MB), after a garbage collection."""
    gc.collect()
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return float("nan")


def _nbytes(weight: torch.Tensor | QuantizedTensor) -> int:
    if isinstance(weight, QuantizedTensor):
        return weight.nbytes
    return weight.numel() * weight.element_size()


def _timed(fn: Callable[[], object]) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


class _OurDecode:
    """B sequences with private copies of one prefilled context, decoded greedily."""

    def __init__(self, runner: ModelRunner, batch: int, context: int, capacity: int, first: int):
        pages_per_seq = -(-capacity // runner.page_size)
        context_pages = context // runner.page_size
        self.runner = runner
        self.tables = [
            list(range(b * pages_per_seq, (b + 1) * pages_per_seq)) for b in range(batch)
        ]
        src = [p for _ in range(1, batch) for p in self.tables[0][: context_pages + 1]]
        dst = [p for b in range(1, batch) for p in self.tables[b][: context_pages + 1]]
        if dst:
            kernels.copy_pages(runner.kv_pool, torch.tensor(src), torch.tensor(dst))
        self.position = context
        self.tokens = [first] * batch
        # a hybrid model: sequence b decodes from state slot b, copied from slot 0 (where the
        # context was prefilled) before its first step
        self.restore = [None] + [0] * (batch - 1) if getattr(runner, "is_hybrid", False) else None

    def _state(self, b: int) -> ChunkState | None:
        if self.restore is None:
            return None
        restore, self.restore[b] = self.restore[b], None
        return ChunkState(b, restore)

    def run(self, steps: int) -> float:
        start = time.perf_counter()
        for _ in range(steps):
            logits = self.runner.execute(
                [
                    SeqChunk([tok], self.position, table, True, state=self._state(b))
                    for b, (tok, table) in enumerate(zip(self.tokens, self.tables, strict=True))
                ]
            )
            self.tokens = logits.argmax(-1).tolist()
            self.position += 1
        return time.perf_counter() - start


class _TheirDecode:
    """transformers: the prefilled DynamicCache repeated to B rows, plain forward per step."""

    def __init__(self, model, base_cache, batch: int, first: int):
        self.model = model
        self.cache = copy.deepcopy(base_cache)
        self.cache.batch_repeat_interleave(batch)
        self.tokens = torch.full((batch, 1), first, dtype=torch.long)

    @torch.inference_mode()
    def run(self, steps: int) -> float:
        start = time.perf_counter()
        for _ in range(steps):
            out = self.model(
                input_ids=self.tokens, cache=self.cache, use_cache=True, logits_to_keep=1
            )
            self.tokens = out.logits[:, -1].argmax(-1, keepdim=True)
        return time.perf_counter() - start


class _TheirGenerate:
    """transformers ``generate``: greedy, ``steps`` new tokens after the prefilled context."""

    def __init__(self, model, base_cache, prompt: list[int], batch: int, first: int):
        self.model = model
        self.base = copy.deepcopy(base_cache)
        self.base.batch_repeat_interleave(batch)
        # the cache holds the prompt; generate computes only the uncached last token first
        self.ids = torch.tensor([[*prompt, first]] * batch)

    @torch.inference_mode()
    def run(self, steps: int) -> float:
        cache = copy.deepcopy(self.base)  # a fresh 512-token cache per sample, not timed
        start = time.perf_counter()
        self.model.generate(
            self.ids,
            attention_mask=torch.ones_like(self.ids),
            cache=cache,
            max_new_tokens=steps,
            min_new_tokens=steps,
            do_sample=False,
            pad_token_id=0,
        )
        return time.perf_counter() - start


def main() -> None:
    parser = base_parser(__doc__.splitlines()[0])
    parser.add_argument("--model", default=None, help="GGUF file or HF dir (default: SmolLM2)")
    parser.add_argument("--threads", type=int, default=None, help="torch threads for both sides")
    parser.add_argument("--prefill", type=int, nargs="+", default=[512, 2048])
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 8, 16, 32])
    parser.add_argument("--context", type=int, default=512, help="decode context length")
    parser.add_argument("--steps", type=int, default=8, help="decode steps per sample")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--fp32-baseline",
        action="store_true",
        help="also time a runner over the weights dequantized to fp32 (the pre-quantized path)",
    )
    parser.add_argument("--no-transformers", action="store_true", help="skip transformers")
    parser.add_argument(
        "--kv-dtype", choices=["auto", "fp32", "bf16", "fp16"], default="auto",
        help="our runner's KV pool dtype (auto: the model's)",
    )
    parser.add_argument(
        "--kv-baseline",
        action="store_true",
        help="also time a runner with the model-dtype KV pool, alternating with --kv-dtype's",
    )
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)

    loaded = load_model(args.model, progress=True)
    config = loaded.config
    path = loaded.path
    capacity = args.context + args.steps * (args.repeats + 1) + 1
    page_size = 16
    pages_needed = max(
        max(args.batches) * -(-capacity // page_size),
        -(-max(args.prefill) // page_size),
    )

    def build(model, kv_dtype: str = "auto") -> ModelRunner:
        return ModelRunner.from_loaded(
            model, num_pages=pages_needed, page_size=page_size, device="cpu", dtype="fp32",
            kv_dtype=kv_dtype,
        )

    rss_start = _rss_mb()
    runner = build(loaded, args.kv_dtype)
    kv_baseline = build(loaded) if args.kv_baseline else None
    weights = loaded.weights
    loaded = dataclasses.replace(loaded, weights={})  # the runner holds its own packed copy
    rss_ours = _rss_mb() - sum(_nbytes(w) for w in weights.values()) / 2**20
    baseline = None
    if args.fp32_baseline:
        weights = {
            name: w.dequantize() if isinstance(w, QuantizedTensor) else w
            for name, w in weights.items()
        }
        rss_before = _rss_mb()
        baseline = build(dataclasses.replace(loaded, weights=weights))
        rss_fp32 = _rss_mb() - rss_before
    del weights
    theirs = None
    if not args.no_transformers:
        from transformers import AutoModelForCausalLM

        if path.is_dir():
            theirs = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32)
        else:
            theirs = AutoModelForCausalLM.from_pretrained(
                str(path.parent), gguf_file=path.name, dtype=torch.float32
            )
        theirs.eval()
    threads = torch.get_num_threads()
    generator = torch.Generator().manual_seed(args.seed)

    def random_ids(count: int) -> list[int]:
        return torch.randint(
            FIRST_ORDINARY_TOKEN, config.vocab_size, (count,), generator=generator
        ).tolist()

    results: dict[str, object] = {
        "model": config.name,
        "threads": threads,
        "kernel_backend": runner.kernel_backend,
        "kv_dtype": str(runner.kv_dtype).removeprefix("torch."),
        "native_cpu_kernels": kernels.native_decode_available()
        if runner.device.type == "cpu"
        else False,
        "native_status": kernels.native_status(),
        "torch": torch.__version__,
        "workload": {
            "prefill_tokens": args.prefill,
            "decode_batches": args.batches,
            "decode_context": args.context,
            "decode_steps_per_sample": args.steps,
            "repeats": args.repeats,
        },
        "rss_mb_ours": rss_ours,
        "rss_mb_start": rss_start,
    }
    rows: list[tuple[str, object]] = [
        ("RSS MB: before the runner | with it (less the loaded weights)",
         f"{rss_start:8.1f} | {rss_ours:8.1f}"),
    ]  # fmt: skip
    if baseline is not None:
        results["rss_mb_added_by_fp32_runner"] = rss_fp32
        rows.append(("RSS MB added by the fp32 baseline runner", f"{rss_fp32:8.1f}"))

    with torch.inference_mode():
        for count in args.prefill:
            ids = random_ids(count)
            table = list(range(-(-count // page_size)))
            prefill_fns: dict[str, Callable[[], float]] = {}
            for name, model in (("ours", runner), ("ours_fp32", baseline), ("ours_kv", kv_baseline)):
                if model is not None:
                    prefill_fns[name] = lambda m=model, ids=ids, table=table: _timed(
                        lambda: m.execute([SeqChunk(ids, 0, table, True)])
                    )
            if theirs is not None:
                prefill_fns["transformers"] = lambda ids=ids: _timed(
                    lambda: theirs(torch.tensor([ids]), use_cache=True, logits_to_keep=1)
                )
            seconds = _alternating_medians(prefill_fns, args.repeats)
            for name, value in seconds.items():
                results[f"prefill_{count}_tok_s_{name}"] = count / value
            shown = f"{count / seconds['ours']:8.1f}"
            if theirs is not None:
                results[f"prefill_ratio_{count}"] = seconds["transformers"] / seconds["ours"]
                shown += (
                    f" | transformers {count / seconds['transformers']:8.1f} | "
                    f"{seconds['transformers'] / seconds['ours']:5.2f}x"
                )
            if baseline is not None:
                results[f"quant_speedup_prefill_{count}"] = seconds["ours_fp32"] / seconds["ours"]
                shown += (
                    f" | fp32 {count / seconds['ours_fp32']:8.1f} | "
                    f"{seconds['ours_fp32'] / seconds['ours']:5.2f}x"
                )
            if kv_baseline is not None:
                results[f"kv_speedup_prefill_{count}"] = seconds["ours_kv"] / seconds["ours"]
                shown += (
                    f" | fp32 KV {count / seconds['ours_kv']:8.1f} | "
                    f"{seconds['ours_kv'] / seconds['ours']:5.2f}x"
                )
            rows.append((f"prefill {count:>5} tok/s  ours | ...", shown))

        # decode: one prefilled context, copied per sequence on both sides
        prompt = random_ids(args.context)
        first_table = list(range(-(-capacity // page_size)))
        first = int(runner.execute([SeqChunk(prompt, 0, first_table, True)])[0].argmax())
        for other in (baseline, kv_baseline):
            if other is not None:
                other.execute([SeqChunk(prompt, 0, first_table, True)])
        base_cache = None
        if theirs is not None:
            base_cache = theirs(torch.tensor([prompt]), use_cache=True).cache
        for batch in args.batches:
            runs: dict[str, _OurDecode | _TheirDecode | _TheirGenerate] = {
                "ours": _OurDecode(runner, batch, args.context, capacity, first)
            }
            if baseline is not None:
                runs["ours_fp32"] = _OurDecode(baseline, batch, args.context, capacity, first)
            if kv_baseline is not None:
                runs["ours_kv"] = _OurDecode(kv_baseline, batch, args.context, capacity, first)
            if theirs is not None:
                runs["transformers"] = _TheirGenerate(theirs, base_cache, prompt, batch, first)
                runs["transformers_forward"] = _TheirDecode(theirs, base_cache, batch, first)
            samples: dict[str, list[float]] = {name: [] for name in runs}
            for repeat in range(args.repeats + 1):  # the first round warms up, not counted
                for name, run in runs.items():  # interleaved: drift hits all alike
                    elapsed = run.run(args.steps)
                    if repeat:
                        samples[name].append(elapsed)
            seconds = {name: statistics.median(values) for name, values in samples.items()}
            generated = batch * args.steps
            for name, value in seconds.items():
                results[f"decode_b{batch}_tok_s_{name}"] = generated / value
            shown = f"{generated / seconds['ours']:8.1f}"
            if theirs is not None:
                gen_s, fwd_s = seconds["transformers"], seconds["transformers_forward"]
                results[f"decode_ratio_b{batch}"] = gen_s / seconds["ours"]
                results[f"decode_ratio_b{batch}_vs_forward"] = fwd_s / seconds["ours"]
                shown += (
                    f" | generate {generated / gen_s:8.1f} | forward {generated / fwd_s:8.1f}"
                    f" | {gen_s / seconds['ours']:5.2f}x {fwd_s / seconds['ours']:5.2f}x"
                )
            if baseline is not None:
                speedup = seconds["ours_fp32"] / seconds["ours"]
                results[f"quant_speedup_decode_b{batch}"] = speedup
                shown += f" | fp32 {generated / seconds['ours_fp32']:8.1f} | {speedup:5.2f}x"
            if kv_baseline is not None:
                speedup = seconds["ours_kv"] / seconds["ours"]
                results[f"kv_speedup_decode_b{batch}"] = speedup
                shown += f" | fp32 KV {generated / seconds['ours_kv']:8.1f} | {speedup:5.2f}x"
            rows.append((f"decode b={batch:<3} tok/s  ours | ...", shown))
            del runs

    print_table(
        f"{config.name}: prefixgate runner (quantized weights native where it can) vs "
        f"transformers / the fp32 runner / the fp32 KV pool (CPU, {threads} threads, "
        f"kernels={runner.kernel_backend}, KV {results['kv_dtype']})",
        rows,
    )
    write_json(args.json, results)


if __name__ == "__main__":
    main()
