"""Cascade (shared-prefix) decode attention on CPU: the native kernel vs the torch path.

Workload (SmolLM2-135M's b16 step over a shared system prompt): 16 sequences share a run of
128 pages x 16 tokens = 2,048 tokens, 3 KV heads, GQA 3 (48 query rows per KV head), head_dim
64, fp32 and bf16 pages; each sequence has ~100 tokens of its own.

Measured side by side in one run (medians of ``--repeats``; the callers' threads: torch's):
  * ``shared_half``: the shared run alone, with each row's log-sum-exp: the torch path
    (``_sdpa_with_lse`` on the run's view, bf16 upcast with ``.float()``, as
    ``reference._decode_shared_prefix`` does) vs ``cascade_decode_native``;
  * ``group``: the whole ``_decode_shared_prefix`` (own pages + shared run + merge), with the
    native cascade declined (before) vs taken (after);
  * ``step`` (unless ``--skip-step``): a b16 decode step of the real default model through a
    ``ModelRunner`` (fp32), before (native cascade declined) vs after, interleaved, plus the
    step with ``shared_prefix_attention`` off for reference.

    python -m benchmarks.cascade --json out/cascade.json
"""

from __future__ import annotations

import statistics
import time
from unittest import mock

import torch

from benchmarks.common import base_parser, median_time, print_table, ratio, write_json
from prefixgate.kernels.attention_plan import plan_attention
from prefixgate.kernels.cpu.cascade import cascade_decode_native
from prefixgate.kernels.torch_cpu import attention as reference

BATCH, SHARED_PAGES, OWN_TOKENS, PAGE_SIZE = 16, 128, 100, 16
KV_HEADS, GROUP, HEAD_DIM = 3, 3, 64


def _declined(*args, **kwargs) -> bool:
    return False


def kernel_figures(dtype: torch.dtype, repeats: int) -> dict[str, float]:
    """Per-call times (ms) of the shared half and the whole group, torch vs native."""
    gen = torch.Generator().manual_seed(0)
    own_pages = -(-(OWN_TOKENS + 1) // PAGE_SIZE)
    num_pages = SHARED_PAGES + BATCH * own_pages
    shape = (num_pages, PAGE_SIZE, KV_HEADS, HEAD_DIM)
    k_cache = torch.randn(shape, generator=gen).to(dtype)
    v_cache = torch.randn(shape, generator=gen).to(dtype)
    tables = [
        list(range(SHARED_PAGES))
        + list(range(SHARED_PAGES + b * own_pages, SHARED_PAGES + (b + 1) * own_pages))
        for b in range(BATCH)
    ]
    lens = [SHARED_PAGES * PAGE_SIZE + OWN_TOKENS + 1] * BATCH
    plan = plan_attention(
        tables,
        lens,
        list(range(BATCH + 1)),
        page_size=PAGE_SIZE,
        kv_row_elems=KV_HEADS * HEAD_DIM,
    )
    group = plan.shared[0]
    query = torch.randn(BATCH, KV_HEADS * GROUP, HEAD_DIM, generator=gen)
    scale = HEAD_DIM**-0.5
    out = torch.empty_like(query)
    rows = group.suffix.rows
    shared_len = group.shared_len

    def torch_shared() -> None:  # reference._decode_shared_prefix's shared half
        first = group.shared_first_page
        k_run = k_cache[first : first + SHARED_PAGES].reshape(shared_len, KV_HEADS, HEAD_DIM)
        v_run = v_cache[first : first + SHARED_PAGES].reshape(shared_len, KV_HEADS, HEAD_DIM)
        k_run, v_run = k_run.transpose(0, 1)[None].float(), v_run.transpose(0, 1)[None].float()
        q = query[rows].view(BATCH, KV_HEADS, GROUP, HEAD_DIM).transpose(0, 1)
        reference._sdpa_with_lse(q.reshape(1, KV_HEADS, -1, HEAD_DIM), k_run, v_run, None, scale)

    lse = torch.empty(BATCH, KV_HEADS * GROUP)

    def native_shared() -> None:
        assert cascade_decode_native(
            out, query, k_cache, v_cache, rows, group.shared_pages, shared_len, scale, lse=lse
        )

    def whole_group() -> None:
        reference._decode_shared_prefix(out, query, k_cache, v_cache, group, scale, True)

    def torch_group() -> None:
        with mock.patch.object(reference, "cascade_decode_native", _declined):
            whole_group()

    times = {
        "shared_half_torch_ms": median_time(torch_shared, repeats, warmup=3) * 1e3,
        "shared_half_native_ms": median_time(native_shared, repeats, warmup=3) * 1e3,
        "group_torch_ms": median_time(torch_group, repeats, warmup=3) * 1e3,
        "group_native_ms": median_time(whole_group, repeats, warmup=3) * 1e3,
    }
    times["shared_half_native_over_torch"] = ratio(
        times["shared_half_native_ms"], times["shared_half_torch_ms"]
    )
    times["group_native_over_torch"] = ratio(times["group_native_ms"], times["group_torch_ms"])
    return times


def step_figures(rounds: int) -> dict[str, float]:
    """Median b16 decode step (ms) of the real model over a 2,048-token shared prefix."""
    from prefixgate.engine.loader import load_model
    from prefixgate.engine.runner import ModelRunner, SeqChunk

    shared = SHARED_PAGES * PAGE_SIZE
    per = -(-(OWN_TOKENS + 40) // PAGE_SIZE)
    runner = ModelRunner.from_loaded(
        load_model(None),
        num_pages=SHARED_PAGES + BATCH * per + 8,
        page_size=PAGE_SIZE,
        device="cpu",
        dtype="fp32",
    )
    tables = [
        list(range(SHARED_PAGES))
        + list(range(SHARED_PAGES + b * per, SHARED_PAGES + (b + 1) * per))
        for b in range(BATCH)
    ]
    with torch.inference_mode():
        runner.execute([SeqChunk(list(range(100, 100 + shared)), 0, tables[0], False)])
        for b in range(BATCH):
            own = list(range(500 + b, 500 + b + OWN_TOKENS))
            runner.execute([SeqChunk(own, shared, tables[b], False)])
    position = shared + OWN_TOKENS

    def steps(n: int) -> float:
        # the same position every time: each step rewrites the same slots, contexts stay put
        t0 = time.perf_counter()
        with torch.inference_mode():
            for _ in range(n):
                runner.execute([SeqChunk([7], position, tables[b], True) for b in range(BATCH)])
        return (time.perf_counter() - t0) / n * 1e3

    arms = {"native_cascade": [], "torch_cascade": [], "no_sharing": []}
    for _ in range(rounds):  # interleaved: a noisy machine drifts alike for every arm
        for arm, samples in arms.items():
            runner.shared_prefix_attention = arm != "no_sharing"
            patch = mock.patch.object(
                reference,
                "cascade_decode_native",
                _declined if arm == "torch_cascade" else reference.cascade_decode_native,
            )
            with patch:
                steps(1)
                samples.append(steps(4))
    figures = {f"step_{arm}_ms": statistics.median(v) for arm, v in arms.items()}
    figures["step_native_over_torch_cascade"] = ratio(
        figures["step_native_cascade_ms"], figures["step_torch_cascade_ms"]
    )
    return figures


def main() -> None:
    parser = base_parser(__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=31)
    parser.add_argument("--rounds", type=int, default=5, help="interleaved rounds of the step")
    parser.add_argument("--skip-step", action="store_true", help="kernel figures only")
    parser.add_argument(
        "--threads", type=int, default=None, help="torch threads (default: its own)"
    )
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    results: dict[str, object] = {"threads": torch.get_num_threads()}
    for dtype in (torch.float32, torch.bfloat16):
        figures = kernel_figures(dtype, args.repeats)
        name = str(dtype).removeprefix("torch.")
        results[name] = figures
        print_table(f"{name} pages: 48 rows x 2,048 keys x 3 KV heads (ms)", list(figures.items()))
    if not args.skip_step:
        figures = step_figures(args.rounds)
        results["step"] = figures
        print_table("b16 decode step, 2,048 shared tokens (ms)", list(figures.items()))
    write_json(args.json, results)


if __name__ == "__main__":
    main()
