"""The gated delta rule and its causal conv on CPU, fp32 (kernels/cpu/csrc/gated_delta.c): the
native twins of kernels/torch_cpu/gated_delta.py, same arguments, same results up to rounding
(the tests bound it), and the same contract: a sequence's state is bit-identical however its
tokens are split into calls and whatever else is in the batch.

:func:`gated_delta_rule_fused_native` also does the layer's per-token preparation inside the
kernel (l2-normalised q and k, the q scale, ``g = -exp(A_log) * softplus(a + dt_bias)``,
``beta = sigmoid(b)``, q/k heads shared by ``Hv / Hk`` value heads); :func:`prepare_inputs_torch`
is its torch spelling, the oracle in the tests and the fallback's first half.

Each function returns None, touching nothing, when the native library is not available here or
the tensors are not what it handles (non-CPU, non-fp32, a layout it does not take); the caller
then runs the torch reference.
"""

from __future__ import annotations

import ctypes
from collections.abc import Sequence

import torch

from prefixgate.kernels.cpu.library import library

_p, _i64, _i32, _f32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int, ctypes.c_float
_SIGNATURES = {
    "pg_gated_delta_f32": ([
        *(_p, _i64) * 5,  # q, k, v, g, beta and their row strides
        *(_p, _p, _i32, _f32, _f32),  # a_log, dt_bias (NULL: not fused), key group, eps, scale
        *(_p, _p, _p, _i32),  # state in, state out, query_start_loc, sequences
        *(_i32, _i32, _i32),  # value heads, Dk, Dv
        *(_p, _p, _p, _p, _i32, _i32),  # save index, out, saved, state slots, write at the
        # slots, threads
    ], _i32),
    "pg_causal_conv1d_f32": ([
        *(_p, _i64, _p, _p, _p, _i32, _i32, _i32),  # x, its row stride, weight, conv state,
        # query_start_loc, sequences, channels, kernel size
        *(_p, _p, _p, _p, _p, _i32, _i32),  # save index, out, new state, saved, state
        # slots, write at the slots, threads
    ], _i32),
    "pg_gated_delta_limits": ([_p, _p], _i32),
}  # fmt: skip
_declared: dict[int, tuple[int, int]] = {}  # id(library) -> (max Dk, max conv kernel)


def _native() -> tuple[ctypes.CDLL, int, int] | None:
    """The library with this module's functions declared, and its limits; None without it."""
    lib = library()
    if lib is None or not hasattr(lib, "pg_gated_delta_f32"):
        return None
    if id(lib) not in _declared:
        for name, (argtypes, restype) in _SIGNATURES.items():
            function = getattr(lib, name)
            function.argtypes, function.restype = argtypes, restype
        max_dk, max_kernel = ctypes.c_int(), ctypes.c_int()
        lib.pg_gated_delta_limits(ctypes.byref(max_dk), ctypes.byref(max_kernel))
        _declared[id(lib)] = (max_dk.value, max_kernel.value)
    return (lib, *_declared[id(lib)])


def _fp32_cpu(*tensors: torch.Tensor) -> bool:
    return all(t.dtype == torch.float32 and t.device.type == "cpu" for t in tensors)


def _rows(t: torch.Tensor, shape: tuple[int, ...]) -> bool:
    """``t`` has ``shape`` with everything but the row dimension dense (rows at any stride)."""
    if tuple(t.shape) != shape:
        return False
    dense = 1
    for size, stride in zip(reversed(shape[1:]), reversed(t.stride()[1:]), strict=True):
        if size > 1 and stride != dense:
            return False
        dense *= size
    return True


def _overlap(a: torch.Tensor, b: torch.Tensor) -> bool:
    a_end = a.data_ptr() + a.numel() * a.element_size()
    return a.data_ptr() < b.data_ptr() + b.numel() * b.element_size() and b.data_ptr() < a_end


def _host_index(query_start_loc: Sequence[int], save_rows: Sequence[int],
                total: int) -> tuple[torch.Tensor, torch.Tensor | None] | None:
    """query_start_loc as int64 and each row's save slot (-1: none) as int32; None when they
    are not a well-formed varlen batch of ``total`` rows (the reference's business then)."""
    starts = [int(s) for s in query_start_loc]
    if (len(starts) < 2 or starts[0] != 0 or starts[-1] != total
            or any(b < a for a, b in zip(starts, starts[1:], strict=False))):
        return None
    saves = [int(r) for r in save_rows]
    if len(set(saves)) != len(saves) or any(not 0 <= r < total for r in saves):
        return None
    qsl = torch.tensor(starts, dtype=torch.int64)
    if not saves:
        return qsl, None
    save_index = torch.full((total,), -1, dtype=torch.int32)
    save_index[torch.tensor(saves, dtype=torch.long)] = torch.arange(len(saves), dtype=torch.int32)
    return qsl, save_index


def _slots(state_slots: torch.Tensor | Sequence[int], num_seqs: int,
           pool: int) -> torch.Tensor | None:
    """The slots as int64, or None unless they are ``num_seqs`` distinct entries of the pool
    (two sequences updating one entry in place would race)."""
    slots = [int(s) for s in state_slots]
    if len(slots) != num_seqs or len(set(slots)) != num_seqs or any(
            not 0 <= s < pool for s in slots):
        return None
    return torch.tensor(slots, dtype=torch.int64)


def _destination(state: torch.Tensor, final_state: torch.Tensor | None, num_seqs: int,
                 slotted: bool) -> tuple[torch.Tensor, bool] | None:
    """Where the final states go and whether at the slots: a fresh ``[S, ...]`` (None), the
    state itself (in place: at the slots when ``slotted``), or another ``[S, ...]`` buffer apart
    from the state; None when ``final_state`` is none of these."""
    shape = (num_seqs, *state.shape[1:])
    if final_state is None:
        return torch.empty(shape, dtype=torch.float32), False
    if final_state.data_ptr() == state.data_ptr() and final_state.shape == state.shape:
        return final_state, slotted
    if (tuple(final_state.shape) != shape or not final_state.is_contiguous()
            or not _fp32_cpu(final_state) or _overlap(final_state, state)):
        return None
    return final_state, False


def causal_conv1d_varlen_native(
    x: torch.Tensor,  # [T, C] conv inputs, rows at any stride
    weight: torch.Tensor,  # [C, K] depthwise kernel
    conv_state: torch.Tensor,  # [S, K - 1, C] (with state_slots: a pool [N, K - 1, C])
    query_start_loc: Sequence[int],
    save_rows: Sequence[int] = (),
    *,
    final_state: torch.Tensor | None = None,
    state_slots: torch.Tensor | Sequence[int] | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
    """Depthwise causal conv + SiLU from each sequence's conv state: the native twin of
    ``kernels.torch_cpu.gated_delta.causal_conv1d_varlen``. ``final_state`` and
    ``state_slots`` (keyword only, not in the reference) as in
    :func:`gated_delta_rule_varlen_native`.

    Returns:
        ``(out [T, C], new_conv_state [S, K - 1, C], saved [P, K - 1, C])`` (the middle one is
        ``final_state`` when given), or None when the native path does not take these inputs.
    """
    native = _native()
    if native is None or x.dim() != 2 or weight.dim() != 2:
        return None
    lib, _, max_kernel = native
    total, channels = x.shape
    kernel_size = weight.shape[1]
    num_seqs = len(query_start_loc) - 1
    if (
        not 2 <= kernel_size <= max_kernel
        or not _rows(x, (total, channels))
        or tuple(weight.shape) != (channels, kernel_size)
        or conv_state.dim() != 3
        or tuple(conv_state.shape[1:]) != (kernel_size - 1, channels)
        or state_slots is None and conv_state.shape[0] != num_seqs
        or not (weight.is_contiguous() and conv_state.is_contiguous())
        or not _fp32_cpu(x, weight, conv_state)
    ):
        return None
    index = _host_index(query_start_loc, save_rows, total)
    if index is None:
        return None
    qsl, save_index = index
    slots = None if state_slots is None else _slots(state_slots, num_seqs, conv_state.shape[0])
    if state_slots is not None and slots is None:
        return None
    destination = _destination(conv_state, final_state, num_seqs, slots is not None)
    if destination is None:
        return None
    new_state, write_slots = destination
    out = torch.empty((total, channels), dtype=torch.float32)
    saved = torch.empty((len(save_rows), kernel_size - 1, channels), dtype=torch.float32)
    status = lib.pg_causal_conv1d_f32(
        x.data_ptr(), x.stride(0), weight.data_ptr(), conv_state.data_ptr(), qsl.data_ptr(),
        num_seqs, channels, kernel_size, 0 if save_index is None else save_index.data_ptr(),
        out.data_ptr(), new_state.data_ptr(), saved.data_ptr(),
        0 if slots is None else slots.data_ptr(), int(write_slots), torch.get_num_threads())
    return None if status != 0 else (out, new_state, saved)


def _rule(q, k, v, g, beta, state, query_start_loc, save_rows, fused, final_state,
          state_slots) -> (
        tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None):
    """Both entries: ``fused`` = (a_log, dt_bias, eps, scale) or None."""
    native = _native()
    if native is None or q.dim() != 3 or v.dim() != 3 or state.dim() != 4:
        return None
    lib, max_dk, _ = native
    total, num_q_heads, dk = q.shape
    num_heads, dv = v.shape[1:]
    num_seqs = len(query_start_loc) - 1
    tensors = [q, k, v, g, beta, state]
    if fused is not None:
        a_log, dt_bias = fused[0], fused[1]
        tensors += [a_log, dt_bias]
        if (tuple(a_log.shape) != (num_heads,) or tuple(dt_bias.shape) != (num_heads,)
                or not (a_log.is_contiguous() and dt_bias.is_contiguous())):
            return None
    elif num_q_heads != num_heads:
        return None
    if (
        not 1 <= dk <= max_dk
        or num_q_heads < 1
        or num_heads % num_q_heads
        or not _rows(q, (total, num_q_heads, dk))
        or not _rows(k, (total, num_q_heads, dk))
        or not _rows(v, (total, num_heads, dv))
        or not _rows(g, (total, num_heads))
        or not _rows(beta, (total, num_heads))
        or tuple(state.shape[1:]) != (num_heads, dk, dv)
        or state_slots is None and state.shape[0] != num_seqs
        or not state.is_contiguous()
        or not _fp32_cpu(*tensors)
    ):
        return None
    index = _host_index(query_start_loc, save_rows, total)
    if index is None:
        return None
    qsl, save_index = index
    slots = None if state_slots is None else _slots(state_slots, num_seqs, state.shape[0])
    if state_slots is not None and slots is None:
        return None
    destination = _destination(state, final_state, num_seqs, slots is not None)
    if destination is None:
        return None
    final, write_slots = destination
    out = torch.empty((total, num_heads, dv), dtype=torch.float32)
    saved = torch.empty((len(save_rows), num_heads, dk, dv), dtype=torch.float32)
    a_log_ptr, dt_bias_ptr, eps, scale = (0, 0, 0.0, 1.0) if fused is None else (
        fused[0].data_ptr(), fused[1].data_ptr(), *fused[2:])
    status = lib.pg_gated_delta_f32(
        q.data_ptr(), q.stride(0), k.data_ptr(), k.stride(0), v.data_ptr(), v.stride(0),
        g.data_ptr(), g.stride(0), beta.data_ptr(), beta.stride(0),
        a_log_ptr, dt_bias_ptr, num_heads // num_q_heads, eps, scale,
        state.data_ptr(), final.data_ptr(), qsl.data_ptr(), num_seqs, num_heads, dk, dv,
        0 if save_index is None else save_index.data_ptr(), out.data_ptr(), saved.data_ptr(),
        0 if slots is None else slots.data_ptr(), int(write_slots), torch.get_num_threads())
    return None if status != 0 else (out, final, saved)


def gated_delta_rule_varlen_native(
    q: torch.Tensor,  # [T, Hv, Dk] l2-normalised, scaled; rows at any stride
    k: torch.Tensor,  # [T, Hv, Dk] l2-normalised
    v: torch.Tensor,  # [T, Hv, Dv]
    g: torch.Tensor,  # [T, Hv] log decay (<= 0)
    beta: torch.Tensor,  # [T, Hv]
    state: torch.Tensor,  # [S, Hv, Dk, Dv] fp32 contiguous (or a pool: state_slots)
    query_start_loc: Sequence[int],
    save_rows: Sequence[int] = (),
    *,
    final_state: torch.Tensor | None = None,
    state_slots: torch.Tensor | Sequence[int] | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
    """The recurrence token by token from each sequence's state: the native twin of
    ``kernels.torch_cpu.gated_delta.gated_delta_rule_varlen``.

    Keyword only, not in the reference:

    * ``state_slots``: ``state`` is a pool [N, Hv, Dk, Dv] and sequence s's state is
      ``state[state_slots[s]]`` (distinct slots): read in place, no gather into a batch;
    * ``final_state``: where the final states go: None, a fresh [S, Hv, Dk, Dv]; ``state``
      itself, in place (at the slots with ``state_slots``: no scatter back either); or another
      [S, Hv, Dk, Dv] buffer. A decode step in place neither allocates nor copies the states
      (a fresh [S, Hv, Dk, Dv] result is most of a decode call's cost: docs/benchmarks.md).

    Returns:
        ``(out [T, Hv, Dv], final_state [S, Hv, Dk, Dv], saved [P, Hv, Dk, Dv])``, or None
        when the native path does not take these inputs.
    """
    return _rule(q, k, v, g, beta, state, query_start_loc, save_rows, None, final_state,
                 state_slots)


def gated_delta_rule_fused_native(
    q: torch.Tensor,  # [T, Hk, Dk] raw (after the conv), rows at any stride
    k: torch.Tensor,  # [T, Hk, Dk] raw
    v: torch.Tensor,  # [T, Hv, Dv], Hv a multiple of Hk
    a: torch.Tensor,  # [T, Hv] raw decay input
    b: torch.Tensor,  # [T, Hv] raw beta input
    a_log: torch.Tensor,  # [Hv]
    dt_bias: torch.Tensor,  # [Hv]
    state: torch.Tensor,  # [S, Hv, Dk, Dv] fp32 contiguous, read only
    query_start_loc: Sequence[int],
    save_rows: Sequence[int] = (),
    *,
    scale: float | None = None,  # default Dk ** -0.5
    eps: float = 1e-6,
    final_state: torch.Tensor | None = None,
    state_slots: torch.Tensor | Sequence[int] | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
    """:func:`prepare_inputs_torch` then the rule, in one pass (value head h reads q/k head
    ``h // (Hv / Hk)``, as transformers' ``repeat_interleave``); ``final_state`` and
    ``state_slots`` as in :func:`gated_delta_rule_varlen_native`.

    Returns:
        as :func:`gated_delta_rule_varlen_native`, or None.
    """
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    return _rule(q, k, v, a, b, state, query_start_loc, save_rows, (a_log, dt_bias, eps, scale),
                 final_state, state_slots)


def prepare_inputs_torch(
    q: torch.Tensor, k: torch.Tensor, a: torch.Tensor, b: torch.Tensor, a_log: torch.Tensor,
    dt_bias: torch.Tensor, num_heads: int, *, scale: float | None = None, eps: float = 1e-6,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """The fused entry's preparation in torch (transformers' Qwen3.5 GatedDeltaNet): ``(q, k,
    g, beta)`` as the reference rule takes them, q/k repeated to ``num_heads`` heads."""
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    group = num_heads // q.shape[1]

    def l2norm(x: torch.Tensor) -> torch.Tensor:
        x = x.float()
        return (x * torch.rsqrt((x * x).sum(-1, keepdim=True) + eps)).repeat_interleave(group, 1)

    g = -a_log.float().exp() * torch.nn.functional.softplus(a.float() + dt_bias.float())
    return l2norm(q) * scale, l2norm(k), g, b.float().sigmoid()


__all__ = ["causal_conv1d_varlen_native", "gated_delta_rule_fused_native",
           "gated_delta_rule_varlen_native", "prepare_inputs_torch"]
