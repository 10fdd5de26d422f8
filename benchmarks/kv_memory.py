"""KV memory efficiency of the paged cache (pure cache/, no model).

Workloads (deterministic, seed 0):
  * waste: 2,000 requests whose total length (prompt + output) is drawn from a log-normal
    (median ~1,100 tokens, clipped to [16, 8,192]), page size 16. Paged = slots allocated but
    unused by the real KVCacheManager; contiguous = every request reserves the model's full
    context (8,192) up front, as servers before PagedAttention did.
  * sessions: one budget of 4,096 pages x 16 tokens (65,536 slots). An agent session = a
    2,048-token shared system prompt + 512 tokens of its own (task + turns). Count how many
    fit: contiguous (reserve 8,192 each), paged without sharing, paged with prefix sharing.
  * shared prefix: 100 sessions each holding the same 10,000-token prefix + 64 own tokens;
    pages used with sharing vs without.
  * lookup: find_prefix on a fully cached 8,192-token prompt (hashing + verified lookups),
    reported per 1,000 tokens; alloc/free: allocate + write + commit + free of a 200-token
    prompt, counted as 2 ops per cycle.
"""

from __future__ import annotations

import random
import time

from benchmarks.common import base_parser, median_time, print_table, write_json
from prefixgate.cache import KVCacheManager, TokenSequence

PAGE_SIZE = 16
CONTEXT = 8192


def _run(m: KVCacheManager, seq_id, tokens) -> None:
    alloc = m.allocate(TokenSequence(seq_id, list(tokens)))
    n = len(tokens) - alloc.num_cached_tokens
    m.prepare_write(seq_id, n)
    m.commit_computed(seq_id, n)


def waste(num_requests: int = 2000) -> dict[str, float]:
    rng = random.Random(0)
    lengths = [min(CONTEXT, max(16, int(rng.lognormvariate(7.0, 0.8)))) for _ in range(num_requests)]
    pages = sum(-(-n // PAGE_SIZE) for n in lengths)
    m = KVCacheManager(pages, PAGE_SIZE, watermark=0, enable_caching=False)
    for i, n in enumerate(lengths):
        _run(m, i, [i % 1000] * n)
    paged = m.stats().fragmentation * 100
    contiguous = 100 * (1 - sum(lengths) / (CONTEXT * num_requests))
    return {"waste_pct_paged": paged, "waste_pct_contiguous": contiguous,
            "median_request_tokens": sorted(lengths)[len(lengths) // 2]}


def sessions(num_pages: int = 4096, system_tokens: int = 2048, own_tokens: int = 512) -> dict[str, float]:
    system = [7] * system_tokens

    def count(shared: bool) -> int:
        m = KVCacheManager(num_pages, PAGE_SIZE, watermark=0, enable_caching=shared)
        n = 0
        while True:
            tokens = system + [1000 + n] * own_tokens
            match = m.find_prefix(tokens)
            if m.pages_needed_for_prompt(len(tokens), match) > m.num_free_pages:
                return n
            _run(m, n, tokens)
            n += 1

    contiguous = num_pages * PAGE_SIZE // CONTEXT
    paged, shared = count(False), count(True)
    return {"sessions_contiguous": contiguous, "sessions_paged": paged, "sessions_paged_shared": shared,
            "concurrency_ratio": shared / contiguous}


def shared_prefix(num_sessions: int = 100, prefix_tokens: int = 10_000, own_tokens: int = 64) -> dict[str, float]:
    prefix = [3] * prefix_tokens
    per_session = -(-(prefix_tokens + own_tokens) // PAGE_SIZE)
    used = {}
    for shared in (True, False):
        m = KVCacheManager(num_sessions * per_session + 8, PAGE_SIZE, watermark=0, enable_caching=shared)
        for i in range(num_sessions):
            _run(m, i, prefix + [5000 + i] * own_tokens)
        used[shared] = m.stats().pages_used
    return {"pages_shared": used[True], "pages_unshared": used[False],
            "shared_prefix_reduction": 1 - used[True] / used[False]}


def lookup_speed(prompt_tokens: int = 8192) -> dict[str, float]:
    rng = random.Random(1)
    tokens = [rng.randrange(50_000) for _ in range(prompt_tokens)]
    m = KVCacheManager(prompt_tokens // PAGE_SIZE + 64, PAGE_SIZE, watermark=0)
    _run(m, "warm", tokens)
    assert m.find_prefix(tokens).num_cached_tokens == prompt_tokens - 1
    per_call = median_time(lambda: m.find_prefix(tokens), repeats=21, warmup=3)

    short = [rng.randrange(50_000) for _ in range(200)]
    m2 = KVCacheManager(1024, PAGE_SIZE, watermark=0)
    cycles = 2000
    t0 = time.perf_counter()
    for i in range(cycles):
        _run(m2, i, short)
        m2.free(i)
    elapsed = time.perf_counter() - t0
    return {"lookup_us_per_1k_tokens": per_call * 1e6 * 1000 / prompt_tokens,
            "alloc_free_ops_per_s": 2 * cycles / elapsed}


def main() -> None:
    args = base_parser(__doc__.splitlines()[0]).parse_args()
    results = {"page_size": PAGE_SIZE, "context": CONTEXT}
    for part in (waste, sessions, shared_prefix, lookup_speed):
        results.update(part())
    targets = {
        "waste_pct_paged": results["waste_pct_paged"] < 2,
        "concurrency_ratio": results["concurrency_ratio"] >= 10,
        "shared_prefix_reduction": results["shared_prefix_reduction"] >= 0.95,
        "lookup_us_per_1k_tokens": results["lookup_us_per_1k_tokens"] < 100,
    }
    results["targets_met"] = targets
    print_table("KV memory (benchmarks.kv_memory)", [(k, v) for k, v in results.items() if k != "targets_met"])
    print("targets met:", targets)
    write_json(args.json, results)


if __name__ == "__main__":
    main()
