"""The torch backend's ops over the paged KV layout (see kernels/layout.py).

The production path on CPU (kernels/torch_cpu/backend.py binds them), so they are exact (no
approximations beyond the dtype) and reasonably fast (the tests check them, and every other
backend, against the naive oracle in tests/kernels/oracle.py):

* the step's addressing is planned once (kernels/attention_plan.py; the runner builds the plan
  once per step and every layer reuses it);
* decode rows (``n_s == 1``) of all sequences go through ONE padded page gather + masked SDPA
  per chunk of sequences (sorted by context length so padding stays small), not a Python
  loop per sequence;
* decode rows of sequences that share a run of prefix pages attend to that run once, all
  together (cascade attention, merged by log-sum-exp), then each to its own pages: on CPU
  with native kernels the run is read in place and merged in C (kernels/cpu/cascade.py);
* prefill chunks (``n_s > 1``) of fp32 queries over fp32 or bf16 CPU caches go through the
  native kernel reading the pages in place (kernels/cpu/prefill.py) when the plan allows
  native kernels; otherwise
  SDPA per sequence with a lower-right causal bias (the flash path skips the masked half) and
  ``enable_gqa`` (K/V never expanded per query head);
* decode folds each GQA group into SDPA's row dim; both gather pages into reused buffers
  (kernels/workspace.py) read by SDPA as strided views.

A cache narrower than the query (bf16 pages under an fp32 model, ``--kv-dtype bf16``) is read
as stored and widened: attention runs in the wider of the two dtypes, so the only rounding the
cache adds is the one ``write_kv`` did when it stored K/V.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.nn.attention.bias import causal_lower_right

from prefixgate.kernels.attention_plan import (
    AttentionPlan,
    PaddedDecode,
    SharedPrefixDecode,
    plan_attention,
)
from prefixgate.kernels.checks import check_attention_inputs, check_copy_inputs, check_write_inputs
from prefixgate.kernels.cpu.cascade import cascade_decode_native
from prefixgate.kernels.cpu.decode import KV_DTYPES, paged_decode_native
from prefixgate.kernels.cpu.ops import write_kv_native
from prefixgate.kernels.cpu.prefill import paged_prefill_native
from prefixgate.kernels.workspace import gather_pages


def write_kv_torch(
    key: torch.Tensor,  # [T, Hkv, D]
    value: torch.Tensor,  # [T, Hkv, D]
    k_cache: torch.Tensor,  # [num_pages, page_size, Hkv, D]
    v_cache: torch.Tensor,  # [num_pages, page_size, Hkv, D]
    slot_mapping: torch.Tensor,  # [T] int64, -1 = skip
    use_native: bool = False,
    check: bool = True,
) -> None:
    """Scatter each new token's K/V into its slot (``slot = page * page_size + offset``).

    ``use_native``: fp32 K/V into fp32 or bf16 CPU caches go through the native copy
    (kernels/cpu/ops.py) when it is available; the torch ops below otherwise (both round to
    a narrower cache's dtype to nearest even). ``check=False`` skips the layout validation
    (the caller validated this layout already).
    """
    if check:
        check_write_inputs(key, value, k_cache, v_cache, slot_mapping)
    if use_native and write_kv_native(key, value, k_cache, v_cache, slot_mapping):
        return
    keep = slot_mapping >= 0
    slots = slot_mapping[keep]
    k_flat = k_cache.view(-1, *k_cache.shape[2:])  # [num_slots, Hkv, D]
    v_flat = v_cache.view(-1, *v_cache.shape[2:])
    k_flat.index_copy_(0, slots, key[keep].to(k_cache.dtype))
    v_flat.index_copy_(0, slots, value[keep].to(v_cache.dtype))


def paged_attention_torch(
    query: torch.Tensor,  # [T, Hq, D]
    k_cache: torch.Tensor,  # [num_pages, page_size, Hkv, D]
    v_cache: torch.Tensor,  # [num_pages, page_size, Hkv, D]
    block_tables: torch.Tensor,  # [S, max_pages] int32
    seq_lens: torch.Tensor,  # [S] int32, context length after this step
    query_start_loc: torch.Tensor,  # [S + 1] int32
    scale: float,
    plan: AttentionPlan | None = None,
    check: bool = True,
) -> torch.Tensor:  # [T, Hq, D]
    """Causal attention of each sequence's new query rows over its paged context.

    ``plan``: the step's :class:`AttentionPlan` when the caller built it once for all layers
    (it must describe these same tables and lengths); None = plan here, from one host copy of
    the metadata. ``check=False`` skips the layout validation (the caller validated this
    layout already); the plan-fits-query check below always runs.
    """
    if check:
        check_attention_inputs(query, k_cache, v_cache, block_tables, seq_lens, query_start_loc)
    if plan is None:
        plan = plan_attention(
            block_tables.tolist(),
            seq_lens.tolist(),
            query_start_loc.tolist(),
            page_size=k_cache.shape[1],
            kv_row_elems=k_cache.shape[2] * k_cache.shape[3],
            device=query.device,
        )
    starts, lens = plan.starts, plan.lens
    if len(lens) != seq_lens.shape[0] or starts[-1] > query.shape[0]:
        raise ValueError(
            f"attention plan for {len(lens)} sequences / {starts[-1]} query rows does not fit "
            f"{seq_lens.shape[0]} sequences / {query.shape[0]} rows"
        )
    # dense rows even when query is a strided view (q sliced out of a fused qkv)
    out = torch.empty(query.shape, dtype=query.dtype, device=query.device)
    for s in plan.prefill:
        rows = slice(starts[s], starts[s + 1])
        # native (fp32 query, fp32/bf16 pages, CPU): in place on the pages; it declines the rest
        if plan.use_native and paged_prefill_native(
            out[rows], query[rows], k_cache, v_cache,
            _sequence_pages(block_tables[s], lens[s], k_cache.shape[1]), lens[s], scale,
        ):
            continue
        out[rows] = _prefill_one(query[rows], k_cache, v_cache, block_tables[s], lens[s], scale)
    for chunk in plan.padded:
        _decode_padded(out, query, k_cache, v_cache, chunk, scale, plan.use_native)
    for group in plan.shared:
        _decode_shared_prefix(out, query, k_cache, v_cache, group, scale, plan.use_native)
    return out


def _gather_context(
    k_cache: torch.Tensor,  # [num_pages, page_size, Hkv, D]
    v_cache: torch.Tensor,
    pages: torch.Tensor,  # [B, n_pages] int64, valid page ids
    ctx_len: int,
    role: str = "",
) -> tuple[torch.Tensor, torch.Tensor]:  # K, V: [B, Hkv, ctx_len, D] (strided views)
    batch, n_pages = pages.shape
    flat = pages.reshape(-1)
    k = gather_pages(k_cache, flat, "k" + role)
    v = gather_pages(v_cache, flat, "v" + role)
    k = k.view(batch, n_pages * k_cache.shape[1], *k_cache.shape[2:])
    v = v.view(batch, n_pages * v_cache.shape[1], *v_cache.shape[2:])
    # SDPA takes the head-major view as is: no transposing copy
    return k[:, :ctx_len].transpose(1, 2), v[:, :ctx_len].transpose(1, 2)


def _sequence_pages(block_table: torch.Tensor, ctx_len: int, page_size: int) -> torch.Tensor:
    """The int64 ids of the pages that hold a sequence's first ``ctx_len`` tokens."""
    return block_table[: (ctx_len + page_size - 1) // page_size].long()


def _prefill_one(
    q: torch.Tensor,  # [n, Hq, D]
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_table: torch.Tensor,  # [max_pages] int32
    ctx_len: int,
    scale: float,
) -> torch.Tensor:  # [n, Hq, D]
    n_new = q.shape[0]
    pages = _sequence_pages(block_table, ctx_len, k_cache.shape[1])
    k, v = _gather_context(k_cache, v_cache, pages[None], ctx_len)  # [1, Hkv, C, D]
    dtype = torch.promote_types(q.dtype, k.dtype)
    k, v = k.to(dtype), v.to(dtype)  # no-ops unless the cache is narrower than the query
    q_heads = q.to(dtype).transpose(0, 1)[None]  # [1, Hq, n, D]
    # Row j sits at position ctx_len - n_new + j and sees keys 0..that position: a causal mask
    # aligned to the lower right. Passing it as a causal bias (not a materialised boolean mask)
    # lets SDPA's CPU flash kernel skip the masked half instead of converting an [n, C] mask.
    if n_new == ctx_len:
        o = F.scaled_dot_product_attention(
            q_heads, k, v, is_causal=True, scale=scale, enable_gqa=True
        )
    else:
        bias = causal_lower_right(n_new, ctx_len)
        o = F.scaled_dot_product_attention(
            q_heads, k, v, attn_mask=bias, scale=scale, enable_gqa=True
        )
    return o[0].transpose(0, 1).to(q.dtype)  # [n, Hq, D]


def _grouped_decode_query(query: torch.Tensor, rows: torch.Tensor, num_kv_heads: int, dtype):
    """The decode rows as ``[B, Hkv, G, D]``: each GQA group is G query rows of one KV head."""
    q = query.index_select(0, rows).to(dtype)  # [B, Hq, D]
    return q.view(q.shape[0], num_kv_heads, -1, q.shape[-1])


def _decode_padded(
    out: torch.Tensor,  # [T, Hq, D], written at the chunk's rows
    query: torch.Tensor,  # [T, Hq, D]
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    chunk: PaddedDecode,
    scale: float,
    use_native: bool = True,
) -> None:
    """The single query row of each sequence of a chunk: the native kernel reading pages in
    place when it applies (fp32 query on CPU), else one padded gather + masked SDPA."""
    if use_native and paged_decode_native(
        out, query, k_cache, v_cache, chunk.rows, chunk.pages, chunk.lengths, scale
    ):
        return
    k, v = _gather_context(k_cache, v_cache, chunk.pages, chunk.ctx_len)  # [B, Hkv, C, D]
    dtype = torch.promote_types(query.dtype, k.dtype)
    k, v = k.to(dtype), v.to(dtype)  # no-ops unless the cache is narrower than the query
    # decode needs no causal mask, only padding's
    q = _grouped_decode_query(query, chunk.rows, k_cache.shape[2], dtype)  # [B, Hkv, G, D]
    o = F.scaled_dot_product_attention(q, k, v, attn_mask=chunk.key_mask, scale=scale)
    out[chunk.rows] = o.reshape(o.shape[0], *out.shape[1:]).to(out.dtype)


def _decode_shared_prefix(
    out: torch.Tensor,  # [T, Hq, D], written at the group's rows
    query: torch.Tensor,  # [T, Hq, D]
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    group: SharedPrefixDecode,
    scale: float,
    use_native: bool = True,
) -> None:
    """Cascade attention: all members' rows against the shared run at once, then each member
    against its own pages, merged exactly by log-sum-exp.

    Both partial results stay in fp32 until the merge (a bf16/fp16 cache is upcast here), so
    the split adds no rounding step of the cache's dtype. ``use_native``: the native decode
    kernel writes each member's own-pages result into ``out`` and the native cascade kernel
    attends the run in place and merges into it (kernels/cpu/cascade.py); either declining
    falls through to the torch path below, which overwrites those rows.
    """
    page_size, num_kv_heads, head_dim = k_cache.shape[1:]
    suffix = group.suffix
    if use_native and query.device.type == "cpu" and k_cache.dtype in KV_DTYPES:
        own_lse = torch.empty(suffix.rows.shape[0], query.shape[1], dtype=torch.float32)
        if paged_decode_native(
            out, query, k_cache, v_cache, suffix.rows, suffix.pages, suffix.lengths, scale,
            own_lse,
        ) and cascade_decode_native(
            out, query, k_cache, v_cache, suffix.rows, group.shared_pages, group.shared_len,
            scale, own_lse,
        ):
            return
    q = _grouped_decode_query(query, suffix.rows, num_kv_heads, torch.float32)  # [B, Hkv, G, D]
    batch, _, group_size, _ = q.shape
    # shared run: one "sequence" of B*G query rows per KV head
    if group.shared_first_page is not None:
        first = group.shared_first_page
        n_pages = group.shared_pages.shape[0]
        k_run = k_cache[first : first + n_pages]  # zero-copy view of the contiguous run
        v_run = v_cache[first : first + n_pages]
    else:
        k_run = gather_pages(k_cache, group.shared_pages, "k_shared")
        v_run = gather_pages(v_cache, group.shared_pages, "v_shared")
    k_run = k_run.reshape(group.shared_len, num_kv_heads, head_dim).transpose(0, 1)[None]
    v_run = v_run.reshape(group.shared_len, num_kv_heads, head_dim).transpose(0, 1)[None]
    k_run, v_run = k_run.float(), v_run.float()  # no-ops for the fp32 cache
    q_run = q.transpose(0, 1).reshape(1, num_kv_heads, batch * group_size, head_dim)
    o_run, lse_run = _sdpa_with_lse(q_run, k_run, v_run, None, scale)  # [1, Hkv, B*G, (D)]
    o_run = o_run[0].view(num_kv_heads, batch, group_size, head_dim).transpose(0, 1)
    lse_run = lse_run[0].view(num_kv_heads, batch, group_size).transpose(0, 1)
    # each member's own pages after the run
    o_own, lse_own = _own_pages_with_lse(k_cache, v_cache, suffix, q, scale, use_native)
    # softmax over the union = the two partial softmaxes weighted by their share of the mass
    lse = torch.logaddexp(lse_run, lse_own)
    merged = o_run * torch.exp(lse_run - lse)[..., None]
    merged += o_own * torch.exp(lse_own - lse)[..., None]
    out[suffix.rows] = merged.reshape(batch, *out.shape[1:]).to(out.dtype)


def _own_pages_with_lse(
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    suffix: PaddedDecode,
    q: torch.Tensor,  # [B, Hkv, G, D], contiguous: row b is sequence b of the suffix
    scale: float,
    use_native: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:  # [B, Hkv, G, D], [B, Hkv, G]
    """Each member's fp32 query rows over its own pages, with the log-sum-exp for the merge."""
    batch, num_kv_heads, group_size, head_dim = q.shape
    if use_native and q.device.type == "cpu" and k_cache.dtype in KV_DTYPES:
        flat_q = q.view(batch, num_kv_heads * group_size, head_dim)
        out = torch.empty_like(flat_q)
        lse = torch.empty(batch, num_kv_heads * group_size, dtype=torch.float32)
        rows = torch.arange(batch)
        if paged_decode_native(
            out, flat_q, k_cache, v_cache, rows, suffix.pages, suffix.lengths, scale, lse
        ):
            return out.view(q.shape), lse.view(batch, num_kv_heads, group_size)
    k, v = _gather_context(k_cache, v_cache, suffix.pages, suffix.ctx_len, "_suffix")
    return _sdpa_with_lse(q, k.float(), v.float(), suffix.key_mask, scale)


def _sdpa_with_lse(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None, scale: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """SDPA that also returns each row's log-sum-exp of scaled scores (fp32)."""
    if q.device.type == "cpu":
        # the CPU flash kernel computes the log-sum-exp anyway and returns it; it takes the
        # mask only as an additive bias of the query's dtype
        if mask is not None:
            bias = torch.zeros(mask.shape, dtype=q.dtype, device=q.device)
            mask = bias.masked_fill_(~mask, float("-inf"))
        o, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
            q, k, v, attn_mask=mask, scale=scale
        )
        return o, lse.float()
    scores = torch.matmul(q.float(), k.float().transpose(-1, -2)) * scale
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf"))
    lse = torch.logsumexp(scores, dim=-1)
    return torch.matmul(torch.exp(scores - lse[..., None]), v.float()).to(q.dtype), lse


def copy_pages_torch(kv_pool: torch.Tensor, src: torch.Tensor, dst: torch.Tensor) -> None:
    """Copy whole pages (every layer, K and V): ``kv_pool[:, :, dst] = kv_pool[:, :, src]``."""
    check_copy_inputs(kv_pool, src, dst)
    if src.numel() == 0:
        return
    kv_pool[:, :, dst] = kv_pool[:, :, src]
