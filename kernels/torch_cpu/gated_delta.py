"""The gated delta rule and its short causal convolution over a flat varlen batch: the torch
reference of a hybrid model's linear-attention (Gated DeltaNet) layers.

Layout (one step, prefill chunks and decode tokens of many sequences mixed, like attention):

    x / q / k / v         [T, ...]   rows of every sequence of the step, back to back
    query_start_loc       S + 1      host ints: sequence s owns rows [qsl[s], qsl[s + 1])
    conv_state            [S, K - 1, C]   the K - 1 conv inputs before each sequence's first row
    recurrent state       [S, Hv, Dk, Dv] before each sequence's first row
    save_rows             P          host ints, sorted: global rows after which the state
                                     (conv window and recurrent matrix) is copied out

NOTE: the recurrence runs token by token in every mode (prefill and decode alike), with the
same arithmetic per token, so the state a sequence reaches does not depend on how its tokens
were split into chunks or steps, nor on which other sequences share the step: a continuation
restored from a state checkpoint at block k is bit-identical to a cold run (the hybrid prefix
cache's contract, docs/models.md). A chunked (WY) form is faster on wide hardware but its
rounding depends on the chunk boundaries.

Math (transformers' ``torch_recurrent_gated_delta_rule``, per head, q and k l2-normalised and q
scaled by ``Dk ** -0.5`` by the caller):

    S = S * exp(g_t);  S += k_t (beta_t (v_t - S^T k_t))^T;  o_t = S^T q_t
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import NamedTuple

import torch


def _padded_index(query_start_loc: Sequence[int]) -> tuple[list[int], int]:
    """Row of each (sequence, step) cell of a [S, L] grid in the flat batch; -1 = padding."""
    num_seqs = len(query_start_loc) - 1
    longest = max(query_start_loc[s + 1] - query_start_loc[s] for s in range(num_seqs))
    index = []
    for s in range(num_seqs):
        start, end = query_start_loc[s], query_start_loc[s + 1]
        index.extend(range(start, end))
        index.extend([-1] * (longest - (end - start)))
    return index, longest


def causal_conv1d_varlen(
    x: torch.Tensor,  # [T, C] conv inputs
    weight: torch.Tensor,  # [C, K] depthwise kernel
    conv_state: torch.Tensor,  # [S, K - 1, C]
    query_start_loc: Sequence[int],
    save_rows: Sequence[int] = (),
    *,
    state_slots: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Depthwise causal conv + SiLU over each sequence, continuing from its conv state.

    ``state_slots``: ``conv_state`` is a pool and sequence s starts from ``conv_state[slots[s]]``.

    Returns:
        ``(out [T, C], new_conv_state [S, K - 1, C], saved [P, K - 1, C])``: the new state is
        each sequence's last K - 1 inputs (older ones from its old state when it ran fewer
        rows); ``saved[p]`` is the window ending at row ``save_rows[p]``.
    """
    if state_slots is not None:
        conv_state = conv_state[state_slots]
    num_seqs = len(query_start_loc) - 1
    width = weight.shape[1] - 1
    # one source: every state's rows first, then the step's inputs
    source = torch.cat([conv_state.reshape(num_seqs * width, -1).to(x.dtype), x])
    # row r of sequence s at offset j reads inputs j - K + 1 .. j: negative offsets are state
    taps: list[int] = []
    ends: dict[int, int] = {}  # global row -> its sequence
    for s in range(num_seqs):
        start, end = query_start_loc[s], query_start_loc[s + 1]
        for row in range(start, end):
            ends[row] = s
            for offset in range(row - start - width, row - start + 1):
                taps.append(s * width + width + offset if offset < 0 else num_seqs * width + start + offset)

    def window(s: int, last: int) -> list[int]:  # the K - 1 inputs up to offset ``last``
        start = query_start_loc[s]
        return [s * width + width + o if o < 0 else num_seqs * width + start + o
                for o in range(last - width + 1, last + 1)]

    index = torch.tensor(taps, dtype=torch.long, device=x.device).view(x.shape[0], width + 1)
    windows = source[index]  # [T, K, C]
    out = torch.nn.functional.silu((windows * weight.t().to(x.dtype)).sum(1))
    new_state = torch.stack([
        source[torch.tensor(window(s, query_start_loc[s + 1] - query_start_loc[s] - 1),
                            dtype=torch.long, device=x.device)]
        for s in range(num_seqs)
    ])
    saved = (torch.stack([source[torch.tensor(window(ends[r], r - query_start_loc[ends[r]]),
                                              dtype=torch.long, device=x.device)]
                          for r in save_rows])
             if save_rows else x.new_empty((0, width, x.shape[1])))
    return out, new_state, saved


def gated_delta_rule_varlen(
    q: torch.Tensor,  # [T, Hv, Dk] l2-normalised, scaled
    k: torch.Tensor,  # [T, Hv, Dk] l2-normalised
    v: torch.Tensor,  # [T, Hv, Dv]
    g: torch.Tensor,  # [T, Hv] log decay (<= 0)
    beta: torch.Tensor,  # [T, Hv]
    state: torch.Tensor,  # [S, Hv, Dk, Dv] fp32, read only
    query_start_loc: Sequence[int],
    save_rows: Sequence[int] = (),
    *,
    state_slots: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The recurrence over each sequence's rows from its state (see the module docstring);
    ``state_slots``: ``state`` is a pool, sequence s starts from ``state[slots[s]]``.

    Returns:
        ``(out [T, Hv, Dv] fp32, final_state [S, Hv, Dk, Dv], saved [P, Hv, Dk, Dv])``.
    """
    if state_slots is not None:
        state = state[state_slots]
    num_seqs = len(query_start_loc) - 1
    index, longest = _padded_index(query_start_loc)
    rows = torch.tensor([max(i, 0) for i in index], dtype=torch.long, device=q.device)
    live = torch.tensor([i >= 0 for i in index], device=q.device).view(num_seqs, longest)
    grid = lambda t: t.float()[rows].view(num_seqs, longest, *t.shape[1:])  # noqa: E731
    qs, ks, vs, gs, betas = grid(q), grid(k), grid(v), grid(g), grid(beta)
    # padding cells leave the state untouched: decay exp(0) = 1 and a zero update
    gs = gs.masked_fill(~live[..., None], 0.0)
    betas = betas.masked_fill(~live[..., None], 0.0)
    ks = ks.masked_fill(~live[..., None, None], 0.0)
    s_state = state.float().clone()
    out = q.new_empty((num_seqs, longest, *v.shape[1:]), dtype=torch.float32)
    saves = {r: p for p, r in enumerate(save_rows)}
    saved = state.new_empty((len(save_rows), *state.shape[1:]), dtype=torch.float32)
    save_at = {}  # step -> [(sequence, save index)]
    for r, p in saves.items():
        s = next(i for i in range(num_seqs) if query_start_loc[i] <= r < query_start_loc[i + 1])
        save_at.setdefault(r - query_start_loc[s], []).append((s, p))
    for t in range(longest):
        k_t = ks[:, t]  # [S, Hv, Dk]
        s_state = s_state * gs[:, t].exp()[..., None, None]
        memory = (s_state * k_t[..., None]).sum(-2)  # [S, Hv, Dv]
        delta = (vs[:, t] - memory) * betas[:, t][..., None]
        s_state = s_state + k_t[..., None] * delta[..., None, :]
        out[:, t] = (s_state * qs[:, t][..., None]).sum(-2)
        for s, p in save_at.get(t, ()):
            saved[p] = s_state[s]
    flat = out.view(num_seqs * longest, *v.shape[1:])
    keep = torch.tensor([i for i, r in enumerate(index) if r >= 0], dtype=torch.long, device=q.device)
    return flat[keep], s_state, saved


class GatedDeltaOps(NamedTuple):
    """A backend's linear-attention ops, with the signatures of this module's functions."""

    conv: Callable[..., tuple[torch.Tensor, torch.Tensor, torch.Tensor]]
    rule: Callable[..., tuple[torch.Tensor, torch.Tensor, torch.Tensor]]


def _or_reference(native: Callable[..., object], reference: Callable[..., object]) -> Callable[..., object]:
    def op(*args: object, **kwargs: object) -> object:
        out = native(*args, **kwargs)  # None: inputs the native kernel does not take
        return reference(*args, **kwargs) if out is None else out
    return op


def bind_ops(native: bool) -> GatedDeltaOps:
    """The torch backend's ops: the native CPU kernels (kernels/cpu/gated_delta.py) when
    ``native`` and the library builds here, else this module's reference."""
    reference = GatedDeltaOps(causal_conv1d_varlen, gated_delta_rule_varlen)
    if not native:
        return reference
    from prefixgate.kernels.cpu import gated_delta as cpu
    from prefixgate.kernels.cpu.library import library

    if library() is None:
        return reference
    return GatedDeltaOps(_or_reference(cpu.causal_conv1d_varlen_native, causal_conv1d_varlen),
                         _or_reference(cpu.gated_delta_rule_varlen_native, gated_delta_rule_varlen))


__all__ = ["GatedDeltaOps", "bind_ops", "causal_conv1d_varlen", "gated_delta_rule_varlen"]
