"""Builders for paged-attention test batches (the naive oracle: tests/kernels/oracle.py).

A batch is described by, per sequence, its context length after this step and how many of
those positions are new query rows (1 = decode, >1 = prefill chunk after a cached prefix,
== context = prefill from scratch). Pages are handed out from a shuffled permutation, so
block tables are non-contiguous and out of order, and every slot NOT holding a sequence's
context is filled with large garbage (or NaN) that must never reach an output.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

DEVICES = ["cuda"] if torch.cuda.is_available() else ["cpu"]  # where Triton kernels run
ALL_DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])

@dataclass(frozen=True, slots=True)
class PagedBatch:
    """One flat attention batch over a paged cache (tensors as ``paged_attention`` takes them)."""

    query: torch.Tensor  # [T, Hq, D]
    k_cache: torch.Tensor  # [num_pages, page_size, Hkv, D]
    v_cache: torch.Tensor  # [num_pages, page_size, Hkv, D]
    block_tables: torch.Tensor  # [S, max_pages] int32
    seq_lens: torch.Tensor  # [S] int32
    query_start_loc: torch.Tensor  # [S + 1] int32
    scale: float

    def args(self) -> tuple:
        """Positional arguments of ``paged_attention``."""
        return (
            self.query,
            self.k_cache,
            self.v_cache,
            self.block_tables,
            self.seq_lens,
            self.query_start_loc,
            self.scale,
        )

def make_paged_batch(
    ctx_lens: list[int],
    new_lens: list[int],
    *,
    num_kv_heads: int = 2,
    group_size: int = 1,
    head_dim: int = 32,
    page_size: int = 16,
    dtype: torch.dtype = torch.float32,
    device: str = "cpu",
    seed: int = 0,
    spare_pages: int = 3,
    spare_table_cols: int = 2,
    garbage: float = 1e3,
) -> PagedBatch:
    """A random batch whose context K/V already sits in shuffled pages.

    ``garbage`` fills every slot outside the contexts and the block table columns past each
    sequence's last page (``nan`` makes any stray read poison the output).
    """
    assert len(ctx_lens) == len(new_lens)
    gen = torch.Generator().manual_seed(seed)
    pages_per_seq = [math.ceil(c / page_size) for c in ctx_lens]
    num_pages = sum(pages_per_seq) + spare_pages
    perm = torch.randperm(num_pages, generator=gen).tolist()
    max_pages = max(pages_per_seq, default=0) + spare_table_cols
    # columns past a sequence's pages point at arbitrary (even out-of-range) ids
    block_tables = torch.full((len(ctx_lens), max_pages), -1, dtype=torch.int32)
    shape = (num_pages, page_size, num_kv_heads, head_dim)
    k_cache = torch.full(shape, garbage, dtype=torch.float32)
    v_cache = torch.full(shape, -garbage, dtype=torch.float32)
    next_page = 0
    for s, ctx in enumerate(ctx_lens):
        pages = perm[next_page : next_page + pages_per_seq[s]]
        next_page += pages_per_seq[s]
        block_tables[s, : len(pages)] = torch.tensor(pages, dtype=torch.int32)
        block_tables[s, len(pages) :] = torch.randint(
            num_pages, 10 * num_pages + 10, (max_pages - len(pages),), generator=gen
        ).to(torch.int32)
        for pos in range(ctx):
            page, off = pages[pos // page_size], pos % page_size
            k_cache[page, off] = torch.randn(num_kv_heads, head_dim, generator=gen)
            v_cache[page, off] = torch.randn(num_kv_heads, head_dim, generator=gen)
    total = sum(new_lens)
    query = torch.randn(total, num_kv_heads * group_size, head_dim, generator=gen)
    starts = [0]
    for n in new_lens:
        starts.append(starts[-1] + n)
    return PagedBatch(
        query=query.to(dtype=dtype, device=device),
        k_cache=k_cache.to(dtype=dtype, device=device),
        v_cache=v_cache.to(dtype=dtype, device=device),
        block_tables=block_tables.to(device),
        seq_lens=torch.tensor(ctx_lens, dtype=torch.int32, device=device),
        query_start_loc=torch.tensor(starts, dtype=torch.int32, device=device),
        scale=head_dim**-0.5,
    )

def make_shared_prefix_batch(
    shared_pages: int,
    own_lens: list[int],
    *,
    contiguous: bool = False,
    num_kv_heads: int = 2,
    group_size: int = 1,
    head_dim: int = 32,
    page_size: int = 16,
    dtype: torch.dtype = torch.float32,
    seed: int = 0,
    garbage: float = 1e3,
) -> PagedBatch:
    """Decode rows of sequences whose block tables all start with the same ``shared_pages``.

    Sequence s has context ``shared_pages * page_size + own_lens[s]`` (its new token is the
    last); its own tokens sit in pages of its own. ``contiguous`` puts the shared run at
    consecutive page ids (a zero-copy view for the torch backend), else shuffled ids.
    """
    gen = torch.Generator().manual_seed(seed)
    own_pages = [math.ceil(n / page_size) for n in own_lens]
    num_pages = shared_pages + sum(own_pages) + 3
    perm = torch.randperm(num_pages, generator=gen).tolist()
    if contiguous:
        run = list(range(1, 1 + shared_pages))
        perm = run + [p for p in perm if p not in run]
    shape = (num_pages, page_size, num_kv_heads, head_dim)
    k_cache = torch.full(shape, garbage)
    v_cache = torch.full(shape, -garbage)
    shared = perm[:shared_pages]
    k_cache[shared] = torch.randn(shared_pages, page_size, num_kv_heads, head_dim, generator=gen)
    v_cache[shared] = torch.randn(shared_pages, page_size, num_kv_heads, head_dim, generator=gen)
    max_pages = shared_pages + max(own_pages) + 1
    block_tables = torch.full((len(own_lens), max_pages), -1, dtype=torch.int32)
    next_page = shared_pages
    for s, n in enumerate(own_lens):
        mine = perm[next_page : next_page + own_pages[s]]
        next_page += own_pages[s]
        block_tables[s, : shared_pages + len(mine)] = torch.tensor(shared + mine)
        for pos in range(n):
            page, off = mine[pos // page_size], pos % page_size
            k_cache[page, off] = torch.randn(num_kv_heads, head_dim, generator=gen)
            v_cache[page, off] = torch.randn(num_kv_heads, head_dim, generator=gen)
    query = torch.randn(len(own_lens), num_kv_heads * group_size, head_dim, generator=gen)
    return PagedBatch(
        query=query.to(dtype),
        k_cache=k_cache.to(dtype),
        v_cache=v_cache.to(dtype),
        block_tables=block_tables,
        seq_lens=torch.tensor([shared_pages * page_size + n for n in own_lens], dtype=torch.int32),
        query_start_loc=torch.arange(len(own_lens) + 1, dtype=torch.int32),
        scale=head_dim**-0.5,
    )

def poison_before(batch: PagedBatch, firsts: list[int]) -> None:
    """NaN into the K/V of each sequence's positions before ``firsts[s]`` (in place): what a
    sliding layer must never read, so any read poisons the output."""
    page_size = batch.k_cache.shape[1]
    tables = batch.block_tables.tolist()
    for s, first in enumerate(firsts):
        for pos in range(max(first, 0)):
            page, off = tables[s][pos // page_size], pos % page_size
            batch.k_cache[page, off] = float("nan")
            batch.v_cache[page, off] = float("nan")

# Comparison tolerances per dtype (outputs are convex combinations of unit-scale values).
TOLERANCES = {
    torch.float32: {"atol": 2e-5, "rtol": 1e-5},
    torch.float16: {"atol": 4e-3, "rtol": 4e-3},
    torch.bfloat16: {"atol": 3e-2, "rtol": 2e-2},
}
