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

Reported: tokens/s per workload for both, ``prefill_ratio_<N>`` and ``decode_ratio_b<B>`` =
ours / transformers (> 1: prefixgate is faster), plus the kernel backend, whether the native
CPU decode kernel ran, and the thread count.

    python -m benchmarks.model --json out/model.json
"""

from __future__ import annotations

import copy
import statistics
import time
from collections.abc import Callable

import torch

from benchmarks.common import base_parser, print_table, write_json
from prefixgate import kernels
from prefixgate.gateway.engine.loader import load_model
from prefixgate.gateway.engine.runner import ModelRunner, SeqChunk

FIRST_ORDINARY_TOKEN = 100  # skip the special tokens at the start of the vocabulary


def _alternating_medians(
    ours: Callable[[], float], theirs: Callable[[], float], repeats: int
) -> tuple[float, float]:
    """Run warm-up once each, then alternate samples; each callable returns seconds."""
    ours()
    theirs()
    our_samples, their_samples = [], []
    for _ in range(repeats):
        our_samples.append(ours())
        their_samples.append(theirs())
    return statistics.median(our_samples), statistics.median(their_samples)


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

    def run(self, steps: int) -> float:
        start = time.perf_counter()
        for _ in range(steps):
            logits = self.runner.execute(
                [
                    SeqChunk([tok], self.position, table, True)
                    for tok, table in zip(self.tokens, self.tables, strict=True)
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
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    from transformers import AutoModelForCausalLM

    loaded = load_model(args.model, progress=True)
    config = loaded.config
    path = loaded.path
    if path.is_dir():
        theirs = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32)
    else:
        theirs = AutoModelForCausalLM.from_pretrained(
            str(path.parent), gguf_file=path.name, dtype=torch.float32
        )
    theirs.eval()
    capacity = args.context + args.steps * (args.repeats + 1) + 1
    page_size = 16
    pages_needed = max(
        max(args.batches) * -(-capacity // page_size),
        -(-max(args.prefill) // page_size),
    )
    runner = ModelRunner.from_loaded(
        loaded, num_pages=pages_needed, page_size=page_size, device="cpu", dtype=torch.float32
    )
    del loaded  # the runner holds its own (packed) copy of the weights
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
    }
    rows: list[tuple[str, object]] = []

    with torch.inference_mode():
        for count in args.prefill:
            ids = random_ids(count)
            table = list(range(-(-count // page_size)))
            ours_s, theirs_s = _alternating_medians(
                lambda ids=ids, table=table: _timed(
                    lambda: runner.execute([SeqChunk(ids, 0, table, True)])
                ),
                lambda ids=ids: _timed(
                    lambda: theirs(torch.tensor([ids]), use_cache=True, logits_to_keep=1)
                ),
                args.repeats,
            )
            results[f"prefill_{count}_tok_s_ours"] = count / ours_s
            results[f"prefill_{count}_tok_s_transformers"] = count / theirs_s
            results[f"prefill_ratio_{count}"] = theirs_s / ours_s
            rows.append(
                (
                    f"prefill {count:>5} tok/s  ours | transformers | ratio",
                    f"{count / ours_s:8.1f} | {count / theirs_s:8.1f} | {theirs_s / ours_s:5.2f}x",
                )
            )

        # decode: one prefilled context, copied per sequence on both sides
        prompt = random_ids(args.context)
        first_table = list(range(-(-capacity // page_size)))
        first = int(runner.execute([SeqChunk(prompt, 0, first_table, True)])[0].argmax())
        prefill_out = theirs(torch.tensor([prompt]), use_cache=True)
        base_cache = prefill_out.cache
        for batch in args.batches:
            ours_run = _OurDecode(runner, batch, args.context, capacity, first)
            forward_run = _TheirDecode(theirs, base_cache, batch, first)
            generate_run = _TheirGenerate(theirs, base_cache, prompt, batch, first)
            samples: dict[str, list[float]] = {"ours": [], "generate": [], "forward": []}
            runs = {"ours": ours_run, "generate": generate_run, "forward": forward_run}
            for repeat in range(args.repeats + 1):  # the first round warms up, not counted
                for name, run in runs.items():  # interleaved: drift hits all three alike
                    seconds = run.run(args.steps)
                    if repeat:
                        samples[name].append(seconds)
            ours_s, gen_s, fwd_s = (statistics.median(samples[n]) for n in runs)
            generated = batch * args.steps
            results[f"decode_b{batch}_tok_s_ours"] = generated / ours_s
            results[f"decode_b{batch}_tok_s_transformers"] = generated / gen_s
            results[f"decode_b{batch}_tok_s_transformers_forward"] = generated / fwd_s
            results[f"decode_ratio_b{batch}"] = gen_s / ours_s
            results[f"decode_ratio_b{batch}_vs_forward"] = fwd_s / ours_s
            rows.append(
                (
                    f"decode b={batch:<3} tok/s  ours | generate | forward | ratios",
                    f"{generated / ours_s:8.1f} | {generated / gen_s:8.1f} | "
                    f"{generated / fwd_s:8.1f} | {gen_s / ours_s:5.2f}x {fwd_s / ours_s:5.2f}x",
                )
            )
            del forward_run, generate_run

    print_table(
        f"{config.name}: prefixgate runner vs transformers (fp32, CPU, {threads} threads, "
        f"kernels={runner.kernel_backend})",
        rows,
    )
    write_json(args.json, results)


if __name__ == "__main__":
    main()
