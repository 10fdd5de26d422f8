"""KV cache precision: what a bf16 pool (``--kv-dtype bf16``) costs in fidelity and buys in speed.

Workload (defaults; every size is a flag):
  * model: the default SmolLM2-135M-Instruct Q4_1 GGUF, fp32 on CPU, two runners over the same
    weights: the fp32 pool (today's default) and a ``--kv-dtype`` pool (default bf16).
  * fidelity: 32 prompts, greedy, up to ``--new-tokens`` (64) each (cut after EOS, as served),
    all decoded together in one batch on each runner (the same batch, so only the pool
    differs): the 6 chats of the
    fidelity suite (tests/engine/test_fidelity.py), its ~1,600-token code-review prompt, the 16
    agent tasks of tests/engine/test_engine.py behind their shared system prompt, and 9 more
    (code, arithmetic, JSON, translation). Reported: the fraction of prompts whose whole greedy
    continuation is identical to the fp32 pool's, each divergent prompt's first differing
    position, and the max |logit difference| of the prompts' last prefill logits.
  * attention: one decode step's paged attention over the 30 layers, batch ``--batch`` (16) x
    context 512 / 1,024 / 2,048 (``--contexts``), SmolLM2's heads (9 Q / 3 KV, D 64), page 16,
    pages shuffled over the pool (as after churn), through ``kernels.paged_attention`` with one
    plan per step as the runner calls it (the native CPU decode kernel where it builds). Samples
    of the fp32 and the bf16 pool alternate (the machine is shared: drift hits both); medians of
    ``--repeats``. Reported: ms per step, the speedup (fp32 median / bf16 median, and the
    median of the per-pair ratios, which drift between pairs does not move) and the K/V bytes
    read. ``--threads`` sets torch's (and so the kernels') thread count.

  * model: whole runner steps (weights, attention, K/V writes), the fp32-pool and the
    ``--kv-dtype`` runner over the same weights: decode of batch ``--batch`` with private
    copies of one prefilled context per ``--contexts`` entry (benchmarks.model's harness), and
    a prefill of 512 / 2,048 tokens. Samples are short (``--decode-steps`` steps, one prefill)
    and alternate runner by runner, ``--repeats`` pairs; reported: tokens/s medians and the
    median per-pair speedup (on a shared machine the pairs, not the medians, are the figure).

``python -m benchmarks.model --kv-dtype bf16 --kv-baseline`` runs the same decode comparison
in that benchmark's longer samples.

    python -m benchmarks.kv_dtype --json out/kv_dtype.json
"""

from __future__ import annotations

import functools
import statistics
import time
from collections.abc import Callable

import torch

from benchmarks.common import base_parser, print_table, write_json
from prefixgate import kernels
from prefixgate.engine.loader import load_model
from prefixgate.engine.runner import ModelRunner, SeqChunk

NUM_LAYERS, NUM_Q_HEADS, NUM_KV_HEADS, HEAD_DIM, PAGE_SIZE = 30, 9, 3, 64, 16
EXTRA_PROMPTS = [
    "Write a Python function that merges two sorted lists, with a docstring.",
    "What is 17 * 23? Show the steps.",
    "Return a JSON object with keys name, age and city for a fictional person.",
    "Translate to Spanish: the cache keeps the pages that agents share.",
    "Explain what a hash collision is, in three sentences.",
    "Give me a bash one-liner that counts the lines of every .py file.",
    "Summarise the plot of Hamlet in two sentences.",
    "List the planets of the solar system in order from the sun.",
    "Why is the sky blue? Answer for a ten-year-old.",
]


def fidelity_prompts(tokenizer) -> list[list[int]]:
    """The prompt set above, as token ids (the fidelity suite's chats come first)."""
    from tests.engine.test_engine import SYSTEM, TASKS
    from tests.engine.test_fidelity import CHATS

    review = "\n".join(
        f"def handler_{i}(request):\n    # route {i}: validate, then answer\n"
        f"    return {{'status': {200 + i % 3}, 'body': request.get('q{i}', 'ünïcødé {i}')}}\n"
        for i in range(30)
    )
    chats = [
        *CHATS,
        [{"role": "user", "content": "Review this:\n" + review}],
        *([{"role": "system", "content": SYSTEM}, {"role": "user", "content": t}] for t in TASKS),
        *([{"role": "user", "content": text}] for text in EXTRA_PROMPTS),
    ]
    return [tokenizer.apply_chat_template(chat) for chat in chats]


def greedy_batch(
    runner: ModelRunner, prompts: list[list[int]], new_tokens: int
) -> tuple[list[list[int]], torch.Tensor]:
    """All prompts decoded greedily together (``new_tokens`` each; EOS is cut afterwards, so
    every step has the same batch on both runners); the tokens and the prefill's last logits."""
    tables, next_page = [], 0
    for prompt in prompts:
        count = -(-(len(prompt) + new_tokens) // runner.page_size)
        tables.append(list(range(next_page, next_page + count)))
        next_page += count
    logits = runner.execute([SeqChunk(p, 0, t, True) for p, t in zip(prompts, tables, strict=True)])
    first_logits = logits.clone()
    outputs = [[token] for token in logits.argmax(-1).tolist()]
    for step in range(1, new_tokens):
        logits = runner.execute(
            [
                SeqChunk([out[-1]], len(p) + step - 1, t, True)
                for p, out, t in zip(prompts, outputs, tables, strict=True)
            ]
        )
        for out, token in zip(outputs, logits.argmax(-1).tolist(), strict=True):
            out.append(token)
    return outputs, first_logits


def first_divergence(a: list[int], b: list[int], eos: tuple[int, ...]) -> int | None:
    """The first position where two continuations differ, each cut after its first EOS (as
    served); None: identical."""
    a, b = _until_eos(a, eos), _until_eos(b, eos)
    differs = next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), None)
    if differs is None and len(a) != len(b):
        return min(len(a), len(b))
    return differs


def _until_eos(tokens: list[int], eos: tuple[int, ...]) -> list[int]:
    ends = [i for i, token in enumerate(tokens) if token in eos]
    return tokens[: ends[0] + 1] if ends else tokens


def attention_step(batch: int, context: int, kv_dtype: torch.dtype, seed: int):
    """One decode step's attention over every layer: a callable running it, and its K/V bytes."""
    gen = torch.Generator().manual_seed(seed)
    pages_per_seq = -(-context // PAGE_SIZE)
    num_pages = batch * pages_per_seq
    pool = kernels.allocate_kv_pool(
        NUM_LAYERS, num_pages, PAGE_SIZE, NUM_KV_HEADS, HEAD_DIM, kv_dtype, "cpu"
    )
    for layer in range(NUM_LAYERS):  # filled layer by layer: no fp32 copy of the whole pool
        pool[layer].copy_(torch.randn(pool[layer].shape, generator=gen))
    tables = torch.randperm(num_pages, generator=gen).view(batch, pages_per_seq).tolist()
    seq_lens = [context] * batch
    starts = list(range(batch + 1))
    plan = kernels.plan_attention(
        tables, seq_lens, starts, page_size=PAGE_SIZE, kv_row_elems=NUM_KV_HEADS * HEAD_DIM
    )
    query = torch.randn(batch, NUM_Q_HEADS, HEAD_DIM, generator=gen)
    block_tables = torch.tensor(tables, dtype=torch.int32)
    lens = torch.tensor(seq_lens, dtype=torch.int32)
    starts_t = torch.tensor(starts, dtype=torch.int32)

    def step() -> torch.Tensor:
        for layer in range(NUM_LAYERS):
            out = kernels.paged_attention(
                query, pool[layer, 0], pool[layer, 1], block_tables, lens, starts_t,
                HEAD_DIM**-0.5, max_query_len=1, plan=plan, check=layer == 0,
            )  # fmt: skip
        return out

    kv_bytes = 2 * NUM_LAYERS * batch * context * NUM_KV_HEADS * HEAD_DIM * pool.element_size()
    return step, kv_bytes


def _pairs(fns: dict[str, Callable[[], float]], repeats: int) -> dict[str, list[float]]:
    """One warm-up each, then ``repeats`` rounds of one sample per callable, alternating."""
    for fn in fns.values():
        fn()
    samples: dict[str, list[float]] = {name: [] for name in fns}
    for _ in range(repeats):
        for name, fn in fns.items():
            samples[name].append(fn())
    return samples


def _prefill(runner: ModelRunner, ids: list[int], table: list[int]) -> float:
    start = time.perf_counter()
    runner.execute([SeqChunk(ids, 0, table, True)])
    return time.perf_counter() - start


def model_steps(args, results: dict) -> list[tuple[str, object]]:
    """Decode and prefill tokens/s of whole runner steps, fp32 pool vs ``--kv-dtype`` pool."""
    from benchmarks.model import _OurDecode

    loaded = load_model(None)
    batch, steps = args.batch, args.decode_steps
    capacity = max(args.contexts) + steps * (args.repeats + 1) + 1
    pages = max(batch * -(-capacity // PAGE_SIZE), -(-max(args.prefills) // PAGE_SIZE))
    runners = {
        name: ModelRunner.from_loaded(loaded, num_pages=pages, kv_dtype=name)
        for name in ("fp32", args.kv_dtype)
    }
    gen = torch.Generator().manual_seed(0)
    rows = []

    def report(key: str, label: str, tokens: int, samples: dict[str, list[float]]) -> None:
        fp32, other = samples["fp32"], samples[args.kv_dtype]
        pairs = [a / b for a, b in zip(fp32, other, strict=True)]
        tok_s = {name: tokens / statistics.median(v) for name, v in samples.items()}
        results[f"{key}_tok_s_fp32"] = tok_s["fp32"]
        results[f"{key}_tok_s_{args.kv_dtype}"] = tok_s[args.kv_dtype]
        results[f"{key}_pair_speedup"] = statistics.median(pairs)
        results[f"{key}_pair_speedups"] = pairs
        rows.append((
            f"{label}: fp32 | {args.kv_dtype} tok/s",
            f"{tok_s['fp32']:8.1f} | {tok_s[args.kv_dtype]:8.1f} | pairs "
            f"{statistics.median(pairs):4.2f}x ({min(pairs):4.2f}-{max(pairs):4.2f})",
        ))  # fmt: skip

    with torch.inference_mode():
        for count in args.prefills:
            ids = torch.randint(100, loaded.config.vocab_size, (count,), generator=gen).tolist()
            table = list(range(-(-count // PAGE_SIZE)))

            fns = {name: functools.partial(_prefill, r, ids, table) for name, r in runners.items()}
            report(f"model_prefill_{count}", f"prefill {count}", count, _pairs(fns, args.repeats))
        for context in args.contexts:
            prompt = torch.randint(100, loaded.config.vocab_size, (context,), generator=gen)
            table = list(range(-(-capacity // PAGE_SIZE)))
            decodes = {}
            for name, runner in runners.items():
                logits = runner.execute([SeqChunk(prompt.tolist(), 0, table, True)])
                decodes[name] = _OurDecode(runner, batch, context, capacity, int(logits.argmax()))
            fns = {name: functools.partial(d.run, steps) for name, d in decodes.items()}
            report(f"model_decode_b{batch}_ctx{context}", f"decode b{batch} x {context}",
                   batch * steps, _pairs(fns, args.repeats))
            del decodes
    return rows


def main(argv: list[str] | None = None) -> dict:
    parser = base_parser(__doc__.splitlines()[0])
    parser.add_argument("--kv-dtype", choices=["bf16", "fp16"], default="bf16")
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--contexts", type=int, nargs="+", default=[512, 1024, 2048])
    parser.add_argument("--repeats", type=int, default=9)
    parser.add_argument("--threads", type=int, default=None, help="torch threads")
    parser.add_argument("--skip-fidelity", action="store_true")
    parser.add_argument("--skip-attention", action="store_true")
    parser.add_argument("--skip-model", action="store_true")
    parser.add_argument("--decode-steps", type=int, default=2)
    parser.add_argument("--prefills", type=int, nargs="+", default=[512, 2048])
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    kv_dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}[args.kv_dtype]
    results: dict[str, object] = {
        "benchmark": "kv_dtype",
        "kv_dtype": args.kv_dtype,
        "threads": torch.get_num_threads(),
        "native_status": kernels.native_status(),
    }
    rows: list[tuple[str, object]] = []

    if not args.skip_fidelity:
        loaded = load_model(None)
        prompts = fidelity_prompts(loaded.tokenizer)
        pages = sum(-(-(len(p) + args.new_tokens) // PAGE_SIZE) for p in prompts)
        outputs, last_logits = {}, {}
        for name, dtype in (("fp32", "fp32"), (args.kv_dtype, args.kv_dtype)):
            runner = ModelRunner.from_loaded(loaded, num_pages=pages, kv_dtype=dtype)
            with torch.inference_mode():
                outputs[name], last_logits[name] = greedy_batch(runner, prompts, args.new_tokens)
            del runner
        eos = tuple(loaded.tokenizer.eos_token_ids)
        divergences = [
            first_divergence(a, b, eos)
            for a, b in zip(outputs["fp32"], outputs[args.kv_dtype], strict=True)
        ]
        lengths = [len(_until_eos(out, eos)) for out in outputs["fp32"]]
        diverged = sorted(d for d in divergences if d is not None)
        identical = divergences.count(None) / len(prompts)
        logit_diff = (last_logits["fp32"] - last_logits[args.kv_dtype]).abs().amax(-1)
        results.update(
            num_prompts=len(prompts),
            new_tokens=args.new_tokens,
            prompt_tokens=[len(p) for p in prompts],
            greedy_identical_fraction=identical,
            first_divergence_positions=divergences,
            fp32_continuation_lengths=lengths,
            prefill_last_logits_max_abs_diff=logit_diff.tolist(),
        )
        rows += [
            (f"greedy identical over {args.new_tokens} tokens ({len(prompts)} prompts)",
             f"{identical:.3f} ({divergences.count(None)}/{len(prompts)})"),
            ("first divergence positions (sorted)", diverged),
            ("prefill last-token logits: max |diff| median / max",
             f"{logit_diff.median().item():.4f} / {logit_diff.max().item():.4f}"),
        ]  # fmt: skip

    if not args.skip_attention:
        with torch.inference_mode():
            for context in args.contexts:
                steps = {}
                for name, dtype in (("fp32", torch.float32), (args.kv_dtype, kv_dtype)):
                    steps[name] = attention_step(args.batch, context, dtype, seed=context)
                samples: dict[str, list[float]] = {name: [] for name in steps}
                for repeat in range(args.repeats + 1):  # the first round warms up
                    for name, (step, _) in steps.items():  # alternating: drift hits both
                        start = time.perf_counter()
                        step()
                        if repeat:
                            samples[name].append(time.perf_counter() - start)
                ms = {name: statistics.median(v) * 1e3 for name, v in samples.items()}
                speedup = ms["fp32"] / ms[args.kv_dtype]
                pairs = [a / b for a, b in zip(samples["fp32"], samples[args.kv_dtype], strict=True)]
                key = f"attention_b{args.batch}_ctx{context}"
                results[f"{key}_ms_fp32"] = ms["fp32"]
                results[f"{key}_ms_{args.kv_dtype}"] = ms[args.kv_dtype]
                results[f"{key}_speedup"] = speedup
                results[f"{key}_pair_speedups"] = pairs
                results[f"{key}_kv_mb_fp32"] = steps["fp32"][1] / 2**20
                rows.append((
                    f"attention, 30 layers, b{args.batch} x {context}: fp32 | {args.kv_dtype} ms",
                    f"{ms['fp32']:7.2f} | {ms[args.kv_dtype]:7.2f} | {speedup:4.2f}x "
                    f"(pairs {statistics.median(pairs):4.2f}x) "
                    f"({steps['fp32'][1] / 2**20:.0f} -> {steps[args.kv_dtype][1] / 2**20:.0f} MB)",
                ))  # fmt: skip
                del steps

    if not args.skip_model:
        rows += model_steps(args, results)

    print_table(
        f"KV pool {args.kv_dtype} vs fp32 (SmolLM2-135M shapes, CPU, "
        f"{torch.get_num_threads()} threads; {kernels.native_status()})",
        rows,
    )
    write_json(args.json, results)
    return results


if __name__ == "__main__":
    main()
