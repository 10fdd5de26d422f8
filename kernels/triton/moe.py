"""The routed experts of a mixture-of-experts MLP on the Triton backend: a grouped GEMM.

Layout as kernels/torch_cpu/moe.py (the torch reference beside it):
    x [T, H], gate_up [E, 2I, H], down [E, H, I], weights / experts [T, k] -> out [T, H].

The step's T * k (token, expert) choices ("pairs", pair p = token p // k's choice p % k) are
sorted by expert on the device and laid out in blocks of BLOCK_M pairs, each block holding
one expert's pairs (the expert's last block padded with the sentinel T * k). One launch of
the grouped GEMM runs every block against its own expert's weight tile, so only the chosen
experts' weights are read, once per block of their tokens; blocks of no expert exit at once
(the grid is sized from shapes alone, so the host never waits for the routing). Two launches:
gate|up over ``x`` (rows gathered by token), then down over the activations (rows by pair),
scaled by each pair's routing weight; the k pairs of a token are summed at the end.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from prefixgate.kernels.checks import require
from prefixgate.kernels.triton.common import check_triton_device, compute_dtype, dot_precision


@triton.jit
def _expert_gemm_kernel(
    a_ptr,  # [rows, K]: x [T, H] (ROW_DIV = k) or the activations [T * k, I] (ROW_DIV = 1)
    stride_a,
    w_ptr,  # [E, N, K], K contiguous
    stride_we,
    stride_wn,
    out_ptr,  # [T * k, N], one row per pair
    stride_out,
    pairs_ptr,  # [num_blocks * BLOCK_M] int32: pair ids sorted by expert; NUM_PAIRS = padding
    block_expert_ptr,  # [num_blocks] int32: each block's expert, -1 = no pairs
    routing_ptr,  # [T * k] routing weight per pair (read when APPLY_WEIGHT)
    num_pairs,
    N,
    K,
    ROW_DIV: tl.constexpr,
    APPLY_WEIGHT: tl.constexpr,
    COMPUTE_DTYPE: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    block = tl.program_id(0)
    expert = tl.load(block_expert_ptr + block).to(tl.int64)
    if expert >= 0:
        pairs = tl.load(pairs_ptr + block * BLOCK_M + tl.arange(0, BLOCK_M))  # [BM]
        valid = pairs < num_pairs
        rows = (pairs // ROW_DIV).to(tl.int64)
        offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)  # [BN]
        offs_k = tl.arange(0, BLOCK_K)
        w_base = w_ptr + expert * stride_we
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            kk = k0 + offs_k
            a = tl.load(a_ptr + rows[:, None] * stride_a + kk[None, :],
                        mask=valid[:, None] & (kk[None, :] < K), other=0.0)  # [BM, BK]
            w = tl.load(w_base + offs_n[None, :] * stride_wn + kk[:, None],
                        mask=(offs_n[None, :] < N) & (kk[:, None] < K), other=0.0)  # [BK, BN]
            acc = tl.dot(a.to(COMPUTE_DTYPE), w.to(COMPUTE_DTYPE), acc,
                         input_precision=DOT_PRECISION)
        if APPLY_WEIGHT:
            routing = tl.load(routing_ptr + pairs, mask=valid, other=0.0).to(tl.float32)
            acc = acc * routing[:, None]
        out = out_ptr + pairs[:, None].to(tl.int64) * stride_out + offs_n[None, :]
        tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=valid[:, None] & (offs_n[None, :] < N))


def align_pairs(
    experts: torch.Tensor, num_experts: int, block_m: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """The pairs sorted by expert in blocks of ``block_m``, and each block's expert.

    Returns:
        ``pairs [num_blocks * block_m]`` int32 (sentinel ``T * k`` in the padding) and
        ``block_expert [num_blocks]`` int32 (-1 past the last used block), computed on the
        device; ``num_blocks`` is an upper bound from the shapes (no host sync).
    """
    flat = experts.flatten().long()  # [P]
    num_pairs = flat.numel()
    order = flat.argsort(stable=True)
    counts = torch.bincount(flat, minlength=num_experts)  # [E]
    blocks = (counts + block_m - 1) // block_m
    block_end = blocks.cumsum(0)
    # each expert wastes under one block: at most ceil(P / block_m) + E blocks in all
    num_blocks = -(-num_pairs // block_m) + num_experts
    block_ids = torch.arange(num_blocks, device=flat.device)
    block_expert = torch.searchsorted(block_end, block_ids, right=True)  # first end > block
    block_expert = torch.where(block_expert < num_experts, block_expert, -1).to(torch.int32)
    by_expert = flat[order]
    rank = torch.arange(num_pairs, device=flat.device) - (counts.cumsum(0) - counts)[by_expert]
    dest = (block_end - blocks)[by_expert] * block_m + rank
    pairs = torch.full((num_blocks * block_m,), num_pairs, dtype=torch.int32, device=flat.device)
    pairs[dest] = order.to(torch.int32)
    return pairs, block_expert


def _expert_gemm(
    a: torch.Tensor, weight: torch.Tensor, out: torch.Tensor, aligned: tuple[torch.Tensor, torch.Tensor],
    row_div: int, routing: torch.Tensor | None, block_m: int,
) -> None:  # fmt: skip
    pairs, block_expert = aligned
    num_n, k_dim = weight.shape[1], weight.shape[2]
    block_n, block_k = 64, 32
    grid = (block_expert.shape[0], triton.cdiv(num_n, block_n))
    _expert_gemm_kernel[grid](
        a, a.stride(0), weight, weight.stride(0), weight.stride(1), out, out.stride(0),
        pairs, block_expert, routing if routing is not None else out, out.shape[0], num_n, k_dim,
        ROW_DIV=row_div, APPLY_WEIGHT=routing is not None,
        COMPUTE_DTYPE=compute_dtype(weight.dtype), DOT_PRECISION=dot_precision(weight.dtype),
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k,
    )  # fmt: skip


def moe_experts_triton(
    x: torch.Tensor,  # [T, H]
    gate_up: torch.Tensor,  # [E, 2I, H]
    down: torch.Tensor,  # [E, H, I]
    weights: torch.Tensor,  # [T, k]
    experts: torch.Tensor,  # [T, k] int64
    *,
    block_m: int | None = None,
) -> torch.Tensor:  # [T, H]
    """``sum_k weights[t, k] * expert_{experts[t, k]}(x[t])`` (SwiGLU experts), computing only
    the chosen experts. ``block_m``: pairs per block (None: from the pairs per expert)."""
    check_triton_device(x)
    num_tokens, hidden = x.shape
    num_experts, two_inter, _ = gate_up.shape
    top_k = experts.shape[1]
    require(gate_up.shape == (num_experts, two_inter, hidden) and two_inter % 2 == 0,
            f"gate_up {tuple(gate_up.shape)} does not fit x {tuple(x.shape)}")
    require(down.shape == (num_experts, hidden, two_inter // 2),
            f"down {tuple(down.shape)} does not fit gate_up {tuple(gate_up.shape)}")
    require(weights.shape == experts.shape == (num_tokens, top_k),
            f"weights {tuple(weights.shape)} / experts {tuple(experts.shape)} do not fit x")
    require(x.stride(1) == 1 and gate_up.stride(2) == 1 and down.stride(2) == 1,
            "x, gate_up and down need a contiguous last dim")
    require(x.dtype == gate_up.dtype == down.dtype,
            f"x, gate_up and down must share a dtype ({x.dtype}, {gate_up.dtype}, {down.dtype})")
    num_pairs = num_tokens * top_k
    if num_pairs == 0:
        return torch.zeros_like(x)
    if block_m is None:  # decode routes a few tokens to each expert: small blocks waste less
        block_m = 16 if num_pairs <= 16 * num_experts else 64
    aligned = align_pairs(experts, num_experts, block_m)
    hidden_act = torch.empty((num_pairs, two_inter), dtype=x.dtype, device=x.device)
    _expert_gemm(x, gate_up, hidden_act, aligned, top_k, None, block_m)
    inter = two_inter // 2
    act = F.silu(hidden_act[:, :inter]) * hidden_act[:, inter:]  # [T * k, I]
    out = torch.empty((num_pairs, hidden), dtype=x.dtype, device=x.device)
    _expert_gemm(act, down, out, aligned, 1, weights.reshape(-1).contiguous(), block_m)
    return out.view(num_tokens, top_k, hidden).sum(1)


__all__ = ["align_pairs", "moe_experts_triton"]
