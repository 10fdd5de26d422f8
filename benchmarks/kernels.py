"""Paged decode attention: achieved bandwidth, and paged vs contiguous.

Workload (one decode step, every sequence has one new query row and a full context):
  * CUDA default: batch 64 sequences x 4,096 context tokens, 8 KV heads, 32 query heads
    (GQA 4), head_dim 128, bf16, page size 16. Pages are a random permutation of the pool
    (non-contiguous block tables, as after churn). K+V read per step: 64 x 4,096 x 8 x 128 x
    2 (K, V) x 2 bytes = 1 GiB, far past the L2, so the kernel is bandwidth-bound.
  * CPU default (the torch backend, the production CPU path): batch 8 x 1,024 tokens, same
    heads, fp32. Every shape is a flag (``--batch --context --kv-heads --q-heads --head-dim
    --page-size --dtype``).

Measured in the same run:
  * paged: ``kernels.paged_attention`` on the pages (backend: auto, or ``--backend``);
    on Triton also the same kernel with split-K off (one split), to show what split-K buys;
  * contiguous: ``torch`` SDPA on the same K/V copied to a dense ``[B, Hkv, C, D]`` layout,
    with each KV head's GQA group folded into the query-length dim (``[B, Hkv, G, D]``), so
    SDPA reads K/V once, like ours (no ``repeat_interleave`` of K/V);
  * copy: device-to-device ``copy_`` of a large tensor, counted as read + write bytes — the
    practical bandwidth ceiling.
Reported: ``decode_bandwidth_gbs`` = K/V bytes / paged time, ``copy_bandwidth_gbs``,
``bandwidth_fraction`` = their ratio, ``paged_over_contiguous`` = paged time / contiguous time
(< 1: paged is faster), and ``max_abs_diff`` between the two outputs.

Timing: after warm-up (Triton compiles on the first call), CUDA events around 10 back-to-back
calls per sample, median of ``--repeats`` samples; on CPU, ``time.perf_counter`` medians.

    python -m benchmarks.kernels --json out/kernels.json
"""

from __future__ import annotations

import math
import statistics
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F

from benchmarks.common import base_parser, print_table, write_json
from prefixgate import kernels

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
CUDA_DEFAULTS = {"batch": 64, "context": 4096, "dtype": "bf16", "repeats": 20, "warmup": 3}
CPU_DEFAULTS = {"batch": 8, "context": 1024, "dtype": "fp32", "repeats": 5, "warmup": 1}
COPY_BYTES = 1 << 30  # large enough that L2 plays no part
CUDA_CALLS_PER_SAMPLE = 10


def time_call(fn: Callable[[], object], device: torch.device, repeats: int, warmup: int) -> float:
    """Median seconds per ``fn()`` call.

    On CUDA each sample brackets ``CUDA_CALLS_PER_SAMPLE`` back-to-back calls with events, so
    the GPU queue stays full and host launch overhead does not count as device time (a
    serving loop launches ahead the same way); on CPU, ``time.perf_counter`` per call.
    """
    for _ in range(warmup):
        fn()
    samples = []
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        for _ in range(repeats):
            start = torch.cuda.Event(enable_timing=True)
            end = torch.cuda.Event(enable_timing=True)
            start.record()
            for _ in range(CUDA_CALLS_PER_SAMPLE):
                fn()
            end.record()
            end.synchronize()
            samples.append(start.elapsed_time(end) / 1e3 / CUDA_CALLS_PER_SAMPLE)
    else:
        for _ in range(repeats):
            t0 = time.perf_counter()
            fn()
            samples.append(time.perf_counter() - t0)
    return statistics.median(samples)


def copy_bandwidth_gbs(device: torch.device, repeats: int, warmup: int) -> float:
    """Device-to-device copy bandwidth, read + write bytes per second, in GB/s."""
    num_bytes = COPY_BYTES if device.type == "cuda" else COPY_BYTES // 8
    src = torch.empty(num_bytes // 2, dtype=torch.bfloat16, device=device).fill_(1.0)
    dst = torch.empty_like(src)
    seconds = time_call(lambda: dst.copy_(src), device, repeats, warmup)
    return 2 * num_bytes / seconds / 1e9


def build_workload(args, device: torch.device, dtype: torch.dtype) -> dict:
    """Paged K/V with shuffled block tables, the same data contiguous, and one query per seq."""
    gen = torch.Generator(device=device).manual_seed(0)
    batch, context, page_size = args.batch, args.context, args.page_size
    pages_per_seq = math.ceil(context / page_size)
    num_pages = batch * pages_per_seq
    cache_shape = (num_pages, page_size, args.kv_heads, args.head_dim)
    k_cache = torch.randn(cache_shape, generator=gen, device=device, dtype=dtype)
    v_cache = torch.randn(cache_shape, generator=gen, device=device, dtype=dtype)
    perm = torch.randperm(num_pages, generator=gen, device=device)
    block_tables = perm.view(batch, pages_per_seq).to(torch.int32)
    query = torch.randn(
        batch, args.q_heads, args.head_dim, generator=gen, device=device, dtype=dtype
    )

    def contiguous(cache: torch.Tensor) -> torch.Tensor:  # [B, Hkv, C, D]
        dense = cache[block_tables.long()].flatten(1, 2)[:, :context]  # [B, C, Hkv, D]
        return dense.permute(0, 2, 1, 3).contiguous()

    return {
        "query": query,
        "k_cache": k_cache,
        "v_cache": v_cache,
        "block_tables": block_tables,
        "seq_lens": torch.full((batch,), context, dtype=torch.int32, device=device),
        "query_start_loc": torch.arange(batch + 1, dtype=torch.int32, device=device),
        "k_dense": contiguous(k_cache),
        "v_dense": contiguous(v_cache),
    }


def main(argv: list[str] | None = None) -> dict:
    parser = base_parser(__doc__.splitlines()[0])
    parser.add_argument("--device", default="auto", help="auto | cuda | cpu")
    parser.add_argument("--backend", default=None, help="kernel backend: auto | triton | torch")
    parser.add_argument("--batch", type=int, default=None)
    parser.add_argument("--context", type=int, default=None, help="context tokens per sequence")
    parser.add_argument("--kv-heads", type=int, default=8)
    parser.add_argument("--q-heads", type=int, default=32)
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--page-size", type=int, default=16)
    parser.add_argument("--dtype", choices=sorted(DTYPES), default=None)
    parser.add_argument("--repeats", type=int, default=None)
    parser.add_argument("--warmup", type=int, default=None)
    args = parser.parse_args(argv)
    if args.device == "auto":
        args.device = "cuda" if torch.cuda.is_available() else "cpu"
    device = torch.device(args.device)
    for name, value in (CUDA_DEFAULTS if device.type == "cuda" else CPU_DEFAULTS).items():
        if getattr(args, name) is None:
            setattr(args, name, value)
    if args.q_heads % args.kv_heads:
        parser.error(f"--q-heads {args.q_heads} must be a multiple of --kv-heads {args.kv_heads}")
    dtype = DTYPES[args.dtype]
    backend = kernels.backend_name(device, args.backend)
    group = args.q_heads // args.kv_heads
    scale = args.head_dim**-0.5
    w = build_workload(args, device, dtype)
    paged_args = (
        w["query"], w["k_cache"], w["v_cache"], w["block_tables"], w["seq_lens"],
        w["query_start_loc"], scale,
    )  # fmt: skip

    def paged() -> torch.Tensor:
        return kernels.paged_attention(*paged_args, max_query_len=1, backend=backend)

    q_grouped = w["query"].view(args.batch, args.kv_heads, group, args.head_dim)

    def contiguous() -> torch.Tensor:
        # the GQA group as G query rows per KV head: no mask needed for decode
        return F.scaled_dot_product_attention(q_grouped, w["k_dense"], w["v_dense"], scale=scale)

    paged_s = time_call(paged, device, args.repeats, args.warmup)
    contiguous_s = time_call(contiguous, device, args.repeats, args.warmup)
    diff = (paged().float() - contiguous().reshape_as(w["query"]).float()).abs().max().item()
    kv_bytes = 2 * args.batch * args.context * args.kv_heads * args.head_dim * dtype.itemsize
    decode_gbs = kv_bytes / paged_s / 1e9
    copy_gbs = copy_bandwidth_gbs(device, args.repeats, args.warmup)

    results = {
        "benchmark": "kernels",
        "device": str(device),
        "gpu_name": torch.cuda.get_device_name(device) if device.type == "cuda" else None,
        "backend": backend,
        "native_cpu_decode": device.type == "cpu" and dtype == torch.float32 and kernels.native_decode_available(),
        "workload": {
            "batch": args.batch,
            "context": args.context,
            "kv_heads": args.kv_heads,
            "q_heads": args.q_heads,
            "head_dim": args.head_dim,
            "page_size": args.page_size,
            "dtype": args.dtype,
            "repeats": args.repeats,
        },
        "kv_bytes_per_step": kv_bytes,
        "decode_time_ms": paged_s * 1e3,
        "contiguous_time_ms": contiguous_s * 1e3,
        "decode_bandwidth_gbs": decode_gbs,
        "copy_bandwidth_gbs": copy_gbs,
        "bandwidth_fraction": decode_gbs / copy_gbs,
        "paged_over_contiguous": paged_s / contiguous_s,
        "max_abs_diff": diff,
    }
    if backend == "triton":
        from prefixgate.kernels.triton.attention import paged_attention_triton
        from prefixgate.kernels.triton.common import device_sms
        from prefixgate.kernels.triton.decode import plan_decode_splits

        pages = w["block_tables"].shape[1]
        plan = plan_decode_splits(
            args.batch, args.kv_heads, pages, args.page_size, device_sms(device)
        )
        one_split_s = time_call(
            lambda: paged_attention_triton(*paged_args, max_query_len=1, pages_per_split=pages),
            device, args.repeats, args.warmup,
        )  # fmt: skip
        results["decode_splits"] = plan.num_splits
        results["no_split_time_ms"] = one_split_s * 1e3
        results["split_k_speedup"] = one_split_s / paged_s

    print_table(
        f"paged decode attention on {results['gpu_name'] or 'cpu'} ({backend} backend): "
        f"batch {args.batch} x ctx {args.context}, {args.kv_heads} KV / {args.q_heads} Q heads, "
        f"D {args.head_dim}, {args.dtype}, page {args.page_size}",
        [(k, v) for k, v in results.items() if k not in ("workload", "benchmark")],
    )
    write_json(args.json, results)
    return results


if __name__ == "__main__":
    main()
