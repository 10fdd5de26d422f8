"""Triton kernels: the gated delta rule and its causal conv over a flat varlen batch, token by
token (the GPU twins of kernels/torch_cpu/gated_delta.py, same arguments and results).

Layout::

    q, k            : [T, Hq, Dk]        rows at any stride, heads dense (Hq = Hv, or Hk fused)
    v               : [T, Hv, Dv]        rows at any stride, heads dense
    g, beta         : [T, Hv]            rows at any stride (fused: the raw a and b)
    state, final    : [S, Hv, Dk, Dv]    fp32 contiguous (either may be a pool [N, ...])
    state_slots     : [S] int64          sequence s's entry of state (arange(S) without a pool)
    final_slots     : [S] int64          sequence s's entry of final (the same slots when the
                                         pool is updated in place, else arange(S))
    saved           : [P, Hv, Dk, Dv]    fp32
    out             : [T, Hv, Dv]        fp32
    query_start_loc : [S + 1] int64      sequence s owns rows [qsl[s], qsl[s + 1])
    save_index      : [T] int32          -1, or the slot of ``saved`` taking the state after it

Grid of the rule: one program per (sequence, value head, block of BLOCK_V state columns), like
fla's fused_recurrent: it holds its [Dk, BLOCK_V] block of the state in registers and walks
the sequence's rows one by one. The columns of the state are independent in the recurrence,
so the split changes no arithmetic; and since one program does the same arithmetic per token
whatever rows it is given, a sequence's state is bit-identical however its tokens are split
into calls and whatever else is in the batch (the hybrid prefix cache's contract).

Grid of the conv: one program per (sequence, block of BLOCK_C channels), walking its rows.

NOTE: whether a row is saved is read per row at run time, not a constexpr: a run that saves
checkpoints and one that does not are the same compiled kernel, so the same arithmetic.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import triton
import triton.language as tl

from prefixgate.kernels.checks import require
from prefixgate.kernels.torch_cpu.gated_delta import GatedDeltaOps
from prefixgate.kernels.triton.common import check_triton_device


@triton.jit
def _gated_delta_kernel(
    q_ptr,  # [T, Hq, Dk]
    k_ptr,  # [T, Hq, Dk]
    v_ptr,  # [T, Hv, Dv]
    g_ptr,  # [T, Hv] (fused: a)
    beta_ptr,  # [T, Hv] (fused: b)
    a_log_ptr,  # [Hv] (fused only)
    dt_bias_ptr,  # [Hv] (fused only)
    state_ptr,  # [S, Hv, Dk, Dv] fp32
    final_ptr,  # [S, Hv, Dk, Dv] fp32
    saved_ptr,  # [P, Hv, Dk, Dv] fp32
    out_ptr,  # [T, Hv, Dv] fp32
    query_start_loc_ptr,  # [S + 1] int64
    save_index_ptr,  # [T] int32
    state_slots_ptr,  # [S] int64
    final_slots_ptr,  # [S] int64
    stride_q_t,
    stride_k_t,
    stride_v_t,
    stride_g_t,
    stride_beta_t,
    eps,
    scale,
    NUM_HEADS: tl.constexpr,
    KEY_GROUP: tl.constexpr,  # value heads per q/k head
    HEAD_DIM_K: tl.constexpr,
    HEAD_DIM_V: tl.constexpr,
    BLOCK_K: tl.constexpr,
    BLOCK_V: tl.constexpr,
    FUSED: tl.constexpr,  # l2-normalise and scale q/k, g and beta from a/b
):
    seq = tl.program_id(0) // NUM_HEADS
    head = tl.program_id(0) % NUM_HEADS
    q_head = head // KEY_GROUP
    offs_k = tl.arange(0, BLOCK_K)
    offs_v = tl.program_id(1) * BLOCK_V + tl.arange(0, BLOCK_V)
    mask_k = offs_k < HEAD_DIM_K
    mask_v = offs_v < HEAD_DIM_V
    mask = mask_k[:, None] & mask_v[None, :]  # [BLOCK_K, BLOCK_V]
    head_size = HEAD_DIM_K * HEAD_DIM_V
    block = offs_k[:, None] * HEAD_DIM_V + offs_v[None, :]
    state_at = (tl.load(state_slots_ptr + seq) * NUM_HEADS + head) * head_size + block
    final_at = (tl.load(final_slots_ptr + seq) * NUM_HEADS + head) * head_size + block
    s = tl.load(state_ptr + state_at, mask=mask, other=0.0)
    if FUSED:
        neg_a = -tl.exp(tl.load(a_log_ptr + head).to(tl.float32))
        dt_bias = tl.load(dt_bias_ptr + head).to(tl.float32)
    start = tl.load(query_start_loc_ptr + seq)
    end = tl.load(query_start_loc_ptr + seq + 1)
    for row in range(start, end):
        q = tl.load(q_ptr + row * stride_q_t + q_head * HEAD_DIM_K + offs_k, mask=mask_k,
                    other=0.0).to(tl.float32)
        k = tl.load(k_ptr + row * stride_k_t + q_head * HEAD_DIM_K + offs_k, mask=mask_k,
                    other=0.0).to(tl.float32)
        v = tl.load(v_ptr + row * stride_v_t + head * HEAD_DIM_V + offs_v, mask=mask_v,
                    other=0.0).to(tl.float32)
        g = tl.load(g_ptr + row * stride_g_t + head).to(tl.float32)
        beta = tl.load(beta_ptr + row * stride_beta_t + head).to(tl.float32)
        if FUSED:
            q = q * (1.0 / tl.sqrt(tl.sum(q * q) + eps)) * scale
            k = k * (1.0 / tl.sqrt(tl.sum(k * k) + eps))
            x = g + dt_bias
            g = neg_a * tl.where(x > 20.0, x, tl.log(1.0 + tl.exp(tl.minimum(x, 20.0))))
            beta = 1.0 / (1.0 + tl.exp(-beta))
        s = s * tl.exp(g)
        memory = tl.sum(s * k[:, None], axis=0)  # [BLOCK_V]
        delta = (v - memory) * beta
        s = s + k[:, None] * delta[None, :]
        out = tl.sum(s * q[:, None], axis=0)
        tl.store(out_ptr + (row * NUM_HEADS + head) * HEAD_DIM_V + offs_v, out, mask=mask_v)
        slot = tl.load(save_index_ptr + row)
        if slot >= 0:
            saved_at = (slot.to(tl.int64) * NUM_HEADS + head) * head_size + block
            tl.store(saved_ptr + saved_at, s, mask=mask)
    tl.store(final_ptr + final_at, s, mask=mask)


@triton.jit
def _conv_input(x_ptr, state_ptr, stride_x_t, start, offset, offs_c, mask_c,
                CHANNELS: tl.constexpr, WIDTH: tl.constexpr):
    """Input ``offset`` of the sequence (negative: row WIDTH + offset of its conv state)."""
    # NOTE: the offset as a block: the interpreter rejects a block mask & a scalar condition
    offsets = tl.zeros_like(offs_c) + offset
    from_x = tl.load(x_ptr + (start + tl.maximum(offsets, 0)) * stride_x_t + offs_c,
                     mask=mask_c & (offsets >= 0), other=0.0).to(tl.float32)
    from_state = tl.load(state_ptr + (WIDTH + tl.minimum(offsets, -1)) * CHANNELS + offs_c,
                         mask=mask_c & (offsets < 0), other=0.0).to(tl.float32)
    return tl.where(offsets < 0, from_state, from_x)


@triton.jit
def _causal_conv1d_kernel(
    x_ptr,  # [T, C]
    weight_ptr,  # [C, K]
    state_ptr,  # [S, K - 1, C]
    out_ptr,  # [T, C]
    new_state_ptr,  # [S, K - 1, C]
    saved_ptr,  # [P, K - 1, C]
    query_start_loc_ptr,  # [S + 1] int64
    save_index_ptr,  # [T] int32
    state_slots_ptr,  # [S] int64
    final_slots_ptr,  # [S] int64
    stride_x_t,
    CHANNELS: tl.constexpr,
    KERNEL: tl.constexpr,
    BLOCK_C: tl.constexpr,
):
    WIDTH: tl.constexpr = KERNEL - 1
    seq = tl.program_id(0)
    offs_c = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    mask_c = offs_c < CHANNELS
    state_seq = state_ptr + tl.load(state_slots_ptr + seq) * WIDTH * CHANNELS
    start = tl.load(query_start_loc_ptr + seq)
    end = tl.load(query_start_loc_ptr + seq + 1)
    for row in range(start, end):
        offset = row - start
        acc = tl.zeros([BLOCK_C], dtype=tl.float32)
        for tap in tl.static_range(KERNEL):
            x = _conv_input(x_ptr, state_seq, stride_x_t, start, offset - WIDTH + tap, offs_c,
                            mask_c, CHANNELS, WIDTH)
            w = tl.load(weight_ptr + offs_c * KERNEL + tap, mask=mask_c, other=0.0).to(tl.float32)
            acc += x * w
        out = acc / (1.0 + tl.exp(-acc))  # SiLU
        tl.store(out_ptr + row * CHANNELS + offs_c, out.to(out_ptr.dtype.element_ty), mask=mask_c)
        slot = tl.load(save_index_ptr + row)
        if slot >= 0:
            saved_row = saved_ptr + slot.to(tl.int64) * WIDTH * CHANNELS
            for i in tl.static_range(WIDTH):
                x = _conv_input(x_ptr, state_seq, stride_x_t, start, offset - WIDTH + 1 + i,
                                offs_c, mask_c, CHANNELS, WIDTH)
                tl.store(saved_row + i * CHANNELS + offs_c, x.to(saved_ptr.dtype.element_ty),
                         mask=mask_c)
    new_state_seq = new_state_ptr + tl.load(final_slots_ptr + seq) * WIDTH * CHANNELS
    for i in tl.static_range(WIDTH):
        x = _conv_input(x_ptr, state_seq, stride_x_t, start, end - start - WIDTH + i, offs_c,
                        mask_c, CHANNELS, WIDTH)
        tl.store(new_state_seq + i * CHANNELS + offs_c, x.to(new_state_ptr.dtype.element_ty),
                 mask=mask_c)


def _host_index(query_start_loc: Sequence[int], save_rows: Sequence[int], total: int,
                device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """query_start_loc as int64, each row's save slot (-1: none) as int32, on ``device``."""
    starts = [int(s) for s in query_start_loc]
    require(len(starts) >= 2 and starts[0] == 0 and starts[-1] == total
            and all(b >= a for a, b in zip(starts, starts[1:], strict=False)),
            f"query_start_loc must rise from 0 to the {total} rows, got {starts}")
    saves = [int(r) for r in save_rows]
    require(len(set(saves)) == len(saves) and all(0 <= r < total for r in saves),
            f"save_rows must be distinct rows of the batch, got {saves}")
    index = [-1] * total
    for slot, row in enumerate(saves):
        index[row] = slot
    return (torch.tensor(starts, dtype=torch.int64, device=device),
            torch.tensor(index or [-1], dtype=torch.int32, device=device))


def _state_slots(state_slots, num_seqs: int, pool: int, device: torch.device) -> torch.Tensor:
    if state_slots is None:
        return torch.arange(num_seqs, dtype=torch.int64, device=device)
    slots = [int(s) for s in state_slots]
    require(len(slots) == num_seqs and len(set(slots)) == num_seqs
            and all(0 <= s < pool for s in slots),
            f"state_slots must be {num_seqs} distinct entries of the pool of {pool}, got {slots}")
    return torch.tensor(slots, dtype=torch.int64, device=device)


def _destination(state: torch.Tensor, final_state: torch.Tensor | None, slots: torch.Tensor,
                 slotted: bool, num_seqs: int, dtype: torch.dtype
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """The final states' tensor and each sequence's entry of it: a fresh ``[S, ...]`` (None),
    ``state`` itself (in place, at the slots), or another ``[S, ...]`` buffer.
    NOTE: in place is safe: each program reads its block of the state before writing it."""
    shape = (num_seqs, *state.shape[1:])
    rows = torch.arange(num_seqs, dtype=torch.int64, device=state.device)
    if final_state is None:
        return torch.empty(shape, dtype=dtype, device=state.device), rows
    if final_state.data_ptr() == state.data_ptr() and final_state.shape == state.shape:
        return final_state, slots if slotted else rows
    require(tuple(final_state.shape) == shape and final_state.is_contiguous()
            and final_state.dtype == dtype and final_state.device == state.device,
            f"final_state must be the state itself or a contiguous {dtype} {list(shape)}")
    return final_state, rows


def _check_rows(name: str, t: torch.Tensor, shape: tuple[int, ...]) -> None:
    require(tuple(t.shape) == shape, f"{name} must be {list(shape)}, got {list(t.shape)}")
    dense = 1
    for size, stride in zip(reversed(shape[1:]), reversed(t.stride()[1:]), strict=True):
        require(size == 1 or stride == dense,
                f"{name} must be dense past its row dimension, got strides {t.stride()}")
        dense *= size


def _rule(q, k, v, g, beta, state, query_start_loc, save_rows, fused, final_state,
          state_slots):
    total, num_q_heads, dk = q.shape
    num_heads, dv = v.shape[1:]
    num_seqs = len(query_start_loc) - 1
    check_triton_device(q)
    require(num_q_heads >= 1 and num_heads % num_q_heads == 0 and
            (fused is not None or num_q_heads == num_heads),
            f"q/k heads ({num_q_heads}) must be the value heads ({num_heads})"
            + (" or divide them" if fused is not None else ""))
    _check_rows("q", q, (total, num_q_heads, dk))
    _check_rows("k", k, (total, num_q_heads, dk))
    _check_rows("v", v, (total, num_heads, dv))
    _check_rows("g", g, (total, num_heads))
    _check_rows("beta", beta, (total, num_heads))
    rows = num_seqs if state_slots is None else state.shape[0]
    require(tuple(state.shape) == (rows, num_heads, dk, dv) and state.is_contiguous()
            and state.dtype == torch.float32,
            f"state must be fp32 contiguous [{rows}, {num_heads}, {dk}, {dv}], got "
            f"{state.dtype} {list(state.shape)}")
    slots = _state_slots(state_slots, num_seqs, state.shape[0], q.device)
    require(all(t.device == q.device for t in (k, v, g, beta, state)),
            "all inputs must be on one device")
    qsl, save_index = _host_index(query_start_loc, save_rows, total, q.device)
    out = torch.empty((total, num_heads, dv), dtype=torch.float32, device=q.device)
    final, final_slots = _destination(state, final_state, slots, state_slots is not None,
                                      num_seqs, torch.float32)
    saved = torch.empty((len(save_rows), num_heads, dk, dv), dtype=torch.float32, device=q.device)
    if fused is not None:
        a_log, dt_bias, eps, scale = fused
        require(tuple(a_log.shape) == (num_heads,) and tuple(dt_bias.shape) == (num_heads,)
                and a_log.is_contiguous() and dt_bias.is_contiguous(),
                f"a_log and dt_bias must be contiguous [{num_heads}]")
    else:
        a_log, dt_bias, eps, scale = state, state, 0.0, 1.0  # unread
    block_v = min(triton.next_power_of_2(dv), 64)
    grid = (num_seqs * num_heads, triton.cdiv(dv, block_v))
    _gated_delta_kernel[grid](
        q, k, v, g, beta, a_log, dt_bias, state, final, saved, out, qsl, save_index, slots,
        final_slots, q.stride(0), k.stride(0), v.stride(0), g.stride(0), beta.stride(0), eps, scale,
        NUM_HEADS=num_heads, KEY_GROUP=num_heads // num_q_heads, HEAD_DIM_K=dk, HEAD_DIM_V=dv,
        BLOCK_K=triton.next_power_of_2(dk), BLOCK_V=block_v, FUSED=fused is not None,
    )
    return out, final, saved


def gated_delta_rule_varlen_triton(
    q: torch.Tensor,  # [T, Hv, Dk] l2-normalised, scaled
    k: torch.Tensor,  # [T, Hv, Dk] l2-normalised
    v: torch.Tensor,  # [T, Hv, Dv]
    g: torch.Tensor,  # [T, Hv] log decay (<= 0)
    beta: torch.Tensor,  # [T, Hv]
    state: torch.Tensor,  # [S, Hv, Dk, Dv] fp32, read only
    query_start_loc: Sequence[int],
    save_rows: Sequence[int] = (),
    *,
    final_state: torch.Tensor | None = None,
    state_slots: torch.Tensor | Sequence[int] | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The recurrence (Triton; same contract as ``gated_delta_rule_varlen``). Keyword only,
    not in the reference, as ``gated_delta_rule_varlen_native``: ``state_slots``, ``state`` is
    a pool and sequence s's state its entry ``state_slots[s]``; ``final_state``, where the
    final states go (None: fresh; ``state`` itself: in place, at the slots with a pool).

    Returns:
        ``(out [T, Hv, Dv] fp32, final_state [S, Hv, Dk, Dv], saved [P, Hv, Dk, Dv])``.
    """
    return _rule(q, k, v, g, beta, state, query_start_loc, save_rows, None, final_state,
                 state_slots)


def gated_delta_rule_fused_triton(
    q: torch.Tensor,  # [T, Hk, Dk] raw
    k: torch.Tensor,  # [T, Hk, Dk] raw
    v: torch.Tensor,  # [T, Hv, Dv]
    a: torch.Tensor,  # [T, Hv]
    b: torch.Tensor,  # [T, Hv]
    a_log: torch.Tensor,  # [Hv]
    dt_bias: torch.Tensor,  # [Hv]
    state: torch.Tensor,  # [S, Hv, Dk, Dv] fp32, read only
    query_start_loc: Sequence[int],
    save_rows: Sequence[int] = (),
    *,
    scale: float | None = None,  # default Dk ** -0.5
    eps: float = 1e-6,
    final_state: torch.Tensor | None = None,
    state_slots: torch.Tensor | Sequence[int] | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``prepare_inputs_torch`` (kernels/cpu/gated_delta.py) and the rule in one kernel."""
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    return _rule(q, k, v, a, b, state, query_start_loc, save_rows, (a_log, dt_bias, eps, scale),
                 final_state, state_slots)


def causal_conv1d_varlen_triton(
    x: torch.Tensor,  # [T, C] rows at any stride
    weight: torch.Tensor,  # [C, K]
    conv_state: torch.Tensor,  # [S, K - 1, C] (with state_slots: a pool [N, K - 1, C])
    query_start_loc: Sequence[int],
    save_rows: Sequence[int] = (),
    *,
    final_state: torch.Tensor | None = None,
    state_slots: torch.Tensor | Sequence[int] | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Depthwise causal conv + SiLU (Triton; same contract as ``causal_conv1d_varlen``);
    ``final_state`` and ``state_slots`` (keyword only) as for the rule.

    Returns:
        ``(out [T, C], new_conv_state [S, K - 1, C], saved [P, K - 1, C])`` in x's dtype.
    """
    check_triton_device(x)
    total, channels = x.shape
    kernel_size = weight.shape[1]
    num_seqs = len(query_start_loc) - 1
    _check_rows("x", x, (total, channels))
    require(tuple(weight.shape) == (channels, kernel_size) and weight.is_contiguous()
            and kernel_size >= 2, f"weight must be contiguous [{channels}, K >= 2]")
    rows = num_seqs if state_slots is None else conv_state.shape[0]
    require(tuple(conv_state.shape) == (rows, kernel_size - 1, channels)
            and conv_state.is_contiguous(),
            f"conv_state must be contiguous [{rows}, {kernel_size - 1}, {channels}]")
    slots = _state_slots(state_slots, num_seqs, conv_state.shape[0], x.device)
    qsl, save_index = _host_index(query_start_loc, save_rows, total, x.device)
    out = torch.empty((total, channels), dtype=x.dtype, device=x.device)
    # NOTE: in place is safe: each program writes its new state after its last read
    new_state, final_slots = _destination(conv_state, final_state, slots,
                                          state_slots is not None, num_seqs, x.dtype)
    saved = torch.empty((len(save_rows), kernel_size - 1, channels), dtype=x.dtype,
                        device=x.device)
    block_c = min(triton.next_power_of_2(channels), 256)
    grid = (num_seqs, triton.cdiv(channels, block_c))
    _causal_conv1d_kernel[grid](
        x, weight, conv_state, out, new_state, saved, qsl, save_index, slots, final_slots,
        x.stride(0),
        CHANNELS=channels, KERNEL=kernel_size, BLOCK_C=block_c,
    )
    return out, new_state, saved


def bind_ops(_native: bool = False) -> GatedDeltaOps:
    """The Triton backend's linear-attention ops (``kernels.gated_delta_ops``)."""
    return GatedDeltaOps(causal_conv1d_varlen_triton, gated_delta_rule_varlen_triton)


__all__ = ["bind_ops", "causal_conv1d_varlen_triton", "gated_delta_rule_fused_triton",
           "gated_delta_rule_varlen_triton"]
