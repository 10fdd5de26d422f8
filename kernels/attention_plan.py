"""Host-side plan of one step's attention for the torch backend, built once, read by every layer.

A step's addressing (block tables, context lengths, query rows) is the same for all layers, so
the torch backend sorts it out once per step instead of once per layer:

* prefill chunks (``n_s > 1``) are listed for the per-sequence SDPA path;
* decode rows are packed into padded page gathers (:class:`PaddedDecode`), sorted by length so
  padding stays small and split so one gather stays under a memory budget;
* **shared-prefix decode** (:class:`SharedPrefixDecode`): decode sequences whose block tables
  start with the same physical pages (agents sharing a system prompt, ``n > 1`` forks) attend
  to that shared run ONCE for all of them: their query rows are stacked into one matrix
  against the shared keys (a GEMM instead of one GEMV per sequence, and the shared K/V read
  once instead of once per sequence), each sequence attends to its own remaining pages
  separately, and the two partial softmaxes are merged exactly through their log-sum-exps
  (cascade attention). With 16 agents on a 2,000-token prompt this reads ~1/10 of the K/V.

Sharing is decided from page ids alone: identical physical pages hold identical K/V, so the
result does not depend on how the pages came to be shared. Only whole pages strictly before
each member's last page are shared, so every member keeps at least one token of its own.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import NamedTuple

import torch

# Upper bound on elements of one gathered K (or V) chunk in the padded decode path: big
# enough that a whole CPU decode batch is usually one chunk, small enough that the reused
# gather buffers (kernels/workspace.py) stay modest (16 Mi elements = 64 MB in fp32).
DECODE_GATHER_BUDGET = 1 << 24

# A shared run is worth a separate pass (one extra SDPA call and a merge per layer, a fixed
# cost) when it saves re-reading at least this many tokens of K/V: (members - 1) * shared tokens.
MIN_SHARED_SAVING_TOKENS = 512


@dataclass(frozen=True, slots=True)
class PaddedDecode:
    """Single decode rows of several sequences, attended with one padded page gather.

    Attributes:
        rows: ``[B]`` int64 query rows (one per sequence).
        pages: ``[B, n_pages]`` int64 page ids to gather; 0 past a sequence's context.
        lengths: ``[B]`` int32 tokens each sequence attends to (from its first listed page).
        ctx_len: padded context length (the longest of the chunk).
        key_mask: ``[B, 1, 1, ctx_len]`` bool (True = attend), or None when no padding.
    """

    rows: torch.Tensor
    pages: torch.Tensor
    lengths: torch.Tensor
    ctx_len: int
    key_mask: torch.Tensor | None


@dataclass(frozen=True, slots=True)
class SharedPrefixDecode:
    """Decode rows of sequences whose contexts start with the same pages (cascade attention).

    Attributes:
        shared_pages: ``[n]`` int64 page ids of the common run.
        shared_first_page: the first id when the run is contiguous (``p, p+1, ...``): the
            shared K/V is then a zero-copy view of the pool; None otherwise.
        shared_len: tokens in the run (``n * page_size``).
        suffix: the members' own pages after the run; its ``rows`` are the members' rows.
    """

    shared_pages: torch.Tensor
    shared_first_page: int | None
    shared_len: int
    suffix: PaddedDecode


@dataclass(frozen=True, slots=True)
class AttentionPlan:
    """Everything the torch backend needs to know about one step's addressing, on the host.

    Attributes:
        starts: ``query_start_loc`` as a list (``S + 1`` entries).
        lens: context length per sequence after this step.
        prefill: sequences with more than one new row (per-sequence SDPA).
        padded: decode groups for the padded gather path.
        shared: decode groups that share a prefix run of pages.
        use_native: decode rows and prefill chunks may use the native CPU kernels
            (kernels/cpu/decode.py, kernels/cpu/prefill.py).
    """

    starts: list[int]
    lens: list[int]
    prefill: list[int]
    padded: list[PaddedDecode]
    shared: list[SharedPrefixDecode]
    use_native: bool = True


def plan_attention(
    block_tables: Sequence[Sequence[int]],
    seq_lens: Sequence[int],
    query_start_loc: Sequence[int],
    *,
    page_size: int,
    kv_row_elems: int,
    device: torch.device | str = "cpu",
    share_prefixes: bool = True,
    use_native: bool = True,
) -> AttentionPlan:
    """Plan one step's attention from host-side lists (the runner has them already).

    Args:
        block_tables: per sequence, its page ids (at least its context's pages).
        seq_lens: per sequence, context length after this step.
        query_start_loc: ``S + 1`` row offsets of each sequence's new query rows.
        page_size: tokens per page.
        kv_row_elems: ``Hkv * head_dim`` (sizes the gather budget).
        device: where the plan's index tensors live (the cache's device).
        share_prefixes: detect shared page runs among decode rows (cascade attention).
        use_native: let decode rows and prefill chunks use the native CPU kernels where they
            apply.

    Raises:
        ValueError: lengths that do not fit together (rows beyond a context, a table shorter
            than its context).
    """
    starts = [int(x) for x in query_start_loc]
    lens = [int(x) for x in seq_lens]
    if len(starts) != len(lens) + 1:
        raise ValueError(
            f"query_start_loc has {len(starts)} entries for {len(lens)} sequences (need S + 1)"
        )
    prefill, decode = _split_rows(block_tables, lens, starts, page_size)
    shared: list[SharedPrefixDecode] = []
    if share_prefixes and len(decode) > 1:
        groups = _shared_runs(decode, block_tables, lens, page_size)
        grouped = {s for members, _ in groups for s in members}
        decode = [s for s in decode if s not in grouped]
        for members, n_shared in groups:
            shared += _shared_decode(members, n_shared, block_tables, lens, starts, page_size,
                                     kv_row_elems, device)
    padded = [
        _padded(chunk, block_tables, lens, starts, page_size, 0, device)
        for chunk in _budget_chunks(decode, lens, kv_row_elems)
    ]
    return AttentionPlan(
        starts=starts,
        lens=lens,
        prefill=prefill,
        padded=padded,
        shared=shared,
        use_native=use_native,
    )


def unshared_decode(
    plan: AttentionPlan,
    block_tables: Sequence[Sequence[int]],
    *,
    page_size: int,
    kv_row_elems: int,
    device: torch.device | str = "cpu",
) -> list[PaddedDecode]:
    """Every decode row of ``plan`` in padded chunks from each sequence's first page, none
    split into a shared run: a sliding layer's window starts past most of a shared prefix, so
    it attends each row's own window instead (the plan's ``padded`` when nothing is shared).
    """
    if not plan.shared:
        return plan.padded
    starts, lens = plan.starts, plan.lens
    decode = [s for s in range(len(lens)) if starts[s + 1] - starts[s] == 1]
    return [
        _padded(chunk, block_tables, lens, starts, page_size, 0, device)
        for chunk in _budget_chunks(decode, lens, kv_row_elems)
    ]


def _split_rows(
    block_tables: Sequence[Sequence[int]], lens: list[int], starts: list[int], page_size: int
) -> tuple[list[int], list[int]]:
    """The sequences with several new rows (prefill) and with one (decode), checked."""
    prefill: list[int] = []
    decode: list[int] = []
    for s, ctx_len in enumerate(lens):
        n_new = starts[s + 1] - starts[s]
        if n_new < 0 or n_new > ctx_len:
            raise ValueError(
                f"sequence {s}: {n_new} new query rows but context length {ctx_len} "
                "(query_start_loc must be non-decreasing and rows <= seq_lens)"
            )
        if ctx_len > 0 and len(block_tables[s]) < -(-ctx_len // page_size):
            raise ValueError(
                f"sequence {s}: block table has {len(block_tables[s])} pages for a context "
                f"of {ctx_len} tokens (page size {page_size})"
            )
        if n_new == 1:
            decode.append(s)
        elif n_new > 1:
            prefill.append(s)
    return prefill, decode


def _shared_decode(
    members: list[int],
    n_shared: int,
    block_tables: Sequence[Sequence[int]],
    lens: list[int],
    starts: list[int],
    page_size: int,
    kv_row_elems: int,
    device: torch.device | str,
) -> list[SharedPrefixDecode]:
    """One group's cascade: its run of ``n_shared`` pages, then each member's own pages."""
    run = [int(p) for p in block_tables[members[0]][:n_shared]]
    contiguous = run == list(range(run[0], run[0] + n_shared))
    run_pages = torch.tensor(run, dtype=torch.int64, device=device)
    skip = n_shared * page_size
    # the members' own pages are gathered on the torch path: keep that under budget
    return [
        SharedPrefixDecode(
            shared_pages=run_pages,
            shared_first_page=run[0] if contiguous else None,
            shared_len=skip,
            suffix=_padded(part, block_tables, lens, starts, page_size, n_shared, device),
        )
        for part in _budget_chunks(members, [n - skip for n in lens], kv_row_elems)
    ]


def _budget_chunks(seqs: list[int], lengths: list[int], kv_row_elems: int) -> list[list[int]]:
    """``seqs`` longest first (so each chunk pads to a similar length), cut so that one padded
    gather of a chunk stays under ``DECODE_GATHER_BUDGET`` elements."""
    chunks: list[list[int]] = []
    chunk: list[int] = []
    for s in sorted(seqs, key=lambda s: lengths[s], reverse=True):
        padded_len = lengths[chunk[0]] if chunk else lengths[s]  # chunk[0] is the longest
        if chunk and (len(chunk) + 1) * padded_len * kv_row_elems > DECODE_GATHER_BUDGET:
            chunks.append(chunk)
            chunk = []
        chunk.append(s)
    if chunk:
        chunks.append(chunk)
    return chunks


def _shared_runs(
    decode: list[int],
    block_tables: Sequence[Sequence[int]],
    lens: list[int],
    page_size: int,
) -> list[tuple[list[int], int]]:
    """Groups of decode sequences starting with the same pages, and each group's run in pages.

    Tables sorted lexicographically put sequences with long common runs next to each other;
    a group is a stretch of that order, its run the smallest common run of neighbours in it.
    Each stretch is either kept whole or split at its weakest link, whichever saves more
    re-read tokens, so one sequence that shares only the first page does not cut the run of
    the 15 that share 125 (a Cartesian tree over the neighbour runs, O(n) and iterative).
    """
    # whole pages strictly before each sequence's last page (which it writes this step)
    caps = {s: (lens[s] - 1) // page_size for s in decode}
    order = sorted(
        (s for s in decode if caps[s] > 0), key=lambda s: list(block_tables[s][: caps[s]])
    )
    if len(order) < 2:
        return []
    links: list[int] = []  # links[i]: common run of order[i] and order[i + 1], in pages
    for a, b in zip(order, order[1:], strict=False):
        limit, table_a, table_b = min(caps[a], caps[b]), block_tables[a], block_tables[b]
        same = 0
        while same < limit and table_a[same] == table_b[same]:
            same += 1
        links.append(same)
    tree = _cartesian_tree(links)
    lo, hi, whole = _keep_whole(tree, links, page_size)
    groups: list[tuple[list[int], int]] = []
    pending = [tree.root]
    while pending:
        node = pending.pop()
        if whole[node]:
            groups.append((order[lo[node] : hi[node] + 1], links[node]))
        else:
            pending.extend(child for child in (tree.left[node], tree.right[node]) if child >= 0)
    return groups


class _Tree(NamedTuple):
    left: list[int]  # per node, its left child (-1: none)
    right: list[int]
    root: int
    postorder: list[int]  # children before parents


def _cartesian_tree(links: list[int]) -> _Tree:
    """The Cartesian tree over ``links`` (minimum at the root; ties chain to the right), built
    with a monotonic stack in O(n); node i covers sequences lo..hi and splits at link i."""
    num_links = len(links)
    left, right = [-1] * num_links, [-1] * num_links
    stack: list[int] = []
    for i, link in enumerate(links):
        last = -1
        while stack and links[stack[-1]] > link:
            last = stack.pop()
        left[i] = last
        if stack:
            right[stack[-1]] = i
        stack.append(i)
    root = stack[0]
    # post-order without recursion (thousands of sequences on one prompt make a deep chain)
    preorder: list[int] = []
    pending = [root]
    while pending:
        node = pending.pop()
        preorder.append(node)
        pending.extend(child for child in (left[node], right[node]) if child >= 0)
    return _Tree(left, right, root, preorder[::-1])


def _keep_whole(
    tree: _Tree, links: list[int], page_size: int
) -> tuple[list[int], list[int], list[bool]]:
    """Per node, the sequences it covers (``lo..hi`` of the order) and whether it is kept as
    one group (it saves more re-read tokens whole than split at its weakest link)."""
    num_links = len(links)
    lo, hi = list(range(num_links)), [i + 1 for i in range(num_links)]
    saved, whole = [0] * num_links, [False] * num_links
    for node in tree.postorder:
        split = 0
        for child in (tree.left[node], tree.right[node]):
            if child >= 0:
                lo[node], hi[node] = min(lo[node], lo[child]), max(hi[node], hi[child])
                split += saved[child]
        together = (hi[node] - lo[node]) * links[node] * page_size  # (members - 1) * run
        whole[node] = together >= MIN_SHARED_SAVING_TOKENS and together >= split
        saved[node] = together if whole[node] else split
    return lo, hi, whole


def _padded(
    seqs: list[int],
    block_tables: Sequence[Sequence[int]],
    lens: list[int],
    starts: list[int],
    page_size: int,
    skip_pages: int,
    device: torch.device | str,
) -> PaddedDecode:
    """A padded gather of each sequence's pages from ``skip_pages`` on."""
    ctx = [lens[s] - skip_pages * page_size for s in seqs]
    max_ctx = max(ctx)
    n_pages = -(-max_ctx // page_size)
    pages: list[int] = []
    for s, length in zip(seqs, ctx, strict=True):
        own = -(-length // page_size)
        pages.extend(int(p) for p in block_tables[s][skip_pages : skip_pages + own])
        # past a sequence's last page: page 0 keeps the gather in bounds; the mask hides it
        pages.extend([0] * (n_pages - own))
    lengths = torch.tensor(ctx, dtype=torch.int32, device=device)
    key_mask = None
    if min(ctx) < max_ctx:
        key_mask = (torch.arange(max_ctx, device=device)[None, :] < lengths[:, None])[:, None, None]
    return PaddedDecode(
        rows=torch.tensor([starts[s] for s in seqs], dtype=torch.int64, device=device),
        pages=torch.tensor(pages, dtype=torch.int64, device=device).view(len(seqs), n_pages),
        lengths=lengths,
        ctx_len=max_ctx,
        key_mask=key_mask,
    )
