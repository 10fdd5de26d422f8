"""A whole decode step of a dense pre-norm decoder in one native call
(kernels/cpu/csrc/decode_step.c), bound once at load from the layers' own bound ops.

A decode step's ops are small, and calling each from Python (a ctypes call and a fresh tensor
per op, ten per layer) is a quarter of a one-sequence step. :func:`bind_dense_decode_step`
reads, once, what the registry bound for every layer (the packed weights and which kernel
reads them) into C descriptors; :meth:`DenseDecodeStep.run` then runs every layer in one call
on preallocated buffers. The kernels and their arguments are the ones the per-op path uses,
so the output is bit-identical to it (tests/engine/models/test_decode_step.py).

Not reentrant: one workspace per model, and the step's page size and K/V dtype are written into
the model's descriptor per call; a model's forward runs on one thread at a time (the engine's).

It takes what the per-op path would run natively and nothing else: fp32 activations, native
RMSNorm, per-head q/k norms or none, SiLU-and-multiply and full-width RoPE (one table; a layer
may have none), each linear one of the native kinds
(fp32, bf16, ggml blocks weight-only, q8), no sandwich norms, no residual
scale, no sliding window or attention sinks, and a step of at most ``MAX_ROWS`` rows (decode
rows, draft verifications, small prefill chunks) whose attention the native kernels take
(:meth:`DenseDecodeStep.accepts`). Anything else stays on
the per-op path: the binding returns None, or the step declines.
"""

from __future__ import annotations

import ctypes
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from prefixgate.kernels.attention_plan import AttentionPlan
from prefixgate.kernels.cpu.library import library
from prefixgate.kernels.cpu.linear import NativeLinear, NativeLinearF32
from prefixgate.kernels.cpu.linear_bf16 import BF16_AMX_MIN_ROWS, NativeLinearBF16
from prefixgate.kernels.cpu.linear_quant import (
    QUANT_AMX_MIN_ROWS,
    QUANT_SCRATCH_MIN_ROWS,
    NativeLinearQ8,
    NativeLinearQuant,
)
from prefixgate.kernels.cpu.ops import NativeHeadNorm, NativeRMSNorm, NativeRope, NativeSiluMul

_P, _I32, _I64, _F32 = ctypes.c_void_p, ctypes.c_int32, ctypes.c_int64, ctypes.c_float

# the most rows of a step the native step runs: decode rows, draft verifications and small
# prefill chunks; a longer chunk's time is its GEMMs and attention, and its workspace
# (rows x ~13 x hidden floats) would stay allocated
MAX_ROWS = 128


class _LinearOp(ctypes.Structure):
    _fields_ = [("kind", _I32), ("qtype", _I32), ("n", _I32), ("k", _I32),
                ("amx_min_rows", _I32), ("scratch_min_rows", _I32), ("packed", _P),
                ("bias", _P)]


class _Layer(ctypes.Structure):
    _fields_ = [("input_norm", _P), ("mlp_norm", _P), ("rotate", _I32), ("q_norm", _P),
                ("k_norm", _P), ("qkv", _LinearOp), ("o", _LinearOp), ("gate_up", _LinearOp),
                ("down", _LinearOp)]


class _Model(ctypes.Structure):
    _fields_ = [("num_layers", _I32), ("hidden", _I32), ("num_heads", _I32),
                ("num_kv_heads", _I32), ("head_dim", _I32), ("inter", _I32),
                ("page_size", _I32), ("kv_bf16", _I32), ("eps", _F32), ("scale", _F32),
                ("layers", ctypes.POINTER(_Layer))]


class _Group(ctypes.Structure):
    _fields_ = [("rows", _P), ("pages", _P), ("max_pages", _I64), ("lengths", _P),
                ("num_seqs", _I32), ("shared_len", _I32), ("shared_pages", _P),
                ("n_shared_pages", _I64), ("own_lse", _P), ("prefill_rows", _I32),
                ("ctx_len", _I32), ("first_row", _I64)]


@dataclass(frozen=True, slots=True)
class DenseLayerOps:
    """One layer's ops as the registry bound them (what :func:`bind_dense_decode_step` reads)."""

    input_norm: object
    qkv: object
    o: object
    mlp_norm: object
    gate_up: object
    act: object
    down: object
    rotate: bool = True  # False: a layer without RoPE (SmolLM3's NoPE layers)
    qk_norm: object | None = None  # per-head q/k norms (Qwen3), before the rotation


def _linear_op(op: object) -> _LinearOp | None:
    """The C descriptor of a bound native linear op, or None for any other op."""
    if not isinstance(op, NativeLinear):
        return None
    packed, bias = op.data
    fields = {"n": op.out_features, "k": op.in_features, "packed": packed.data_ptr(),
              "bias": None if bias is None else bias.data_ptr()}
    if type(op) is NativeLinearF32:
        return _LinearOp(kind=0, **fields)
    if type(op) is NativeLinearQuant:
        return _LinearOp(kind=1, qtype=op._qtype, scratch_min_rows=QUANT_SCRATCH_MIN_ROWS,
                         amx_min_rows=QUANT_AMX_MIN_ROWS if op._amx is not None else 0,
                         **fields)
    if type(op) is NativeLinearBF16:
        return _LinearOp(kind=2, amx_min_rows=BF16_AMX_MIN_ROWS, **fields)
    if type(op) is NativeLinearQ8:
        return _LinearOp(kind=3, qtype=op._qtype, **fields)
    return None


class DenseDecodeStep:
    """Every layer of one decode step in one native call; build with
    :func:`bind_dense_decode_step`."""

    def __init__(self, model: _Model, layers: ctypes.Array, keep: list[object],
                 sizes: tuple[int, int, int, int, int, int]) -> None:
        self._model, self._layers = model, layers
        self._keep = keep  # the ops whose weights the descriptors point into
        self._hidden, self._q, self._kv, self._inter, self._heads, self._head_dim = sizes
        lib = library()
        self._function = lib.pg_dense_decode_step
        self._workspace = torch.empty(0, dtype=torch.float32)
        self._caches: tuple[object, ...] = ()
        self._cache_ptrs: ctypes.Array | None = None
        # the kernels' limits, read once: sequences a cascade group may hold (-1: none), and
        # whether the prefill kernel takes these heads
        group = self._heads // self._model.num_kv_heads
        cascade_ok = self._head_dim % 16 == 0 and self._head_dim <= lib.cascade_max_head_dim
        self._cascade_seqs = lib.cascade_max_rows // group if cascade_ok else -1
        self._prefill_ok = (self._head_dim % 16 == 0 and self._head_dim
                            <= lib.prefill_max_head_dim and group <= lib.prefill_max_group)

    def accepts(self, rows: int, plan: AttentionPlan | None, kv_dtype: torch.dtype) -> bool:
        """Whether the native step runs a step of ``rows`` rows with this attention plan: at
        most :data:`MAX_ROWS` rows (its workspace stays small; a long prefill chunk gains
        nothing from it), and every row's attention one the native kernels take."""
        if (plan is None or not plan.use_native or rows > MAX_ROWS
                or kv_dtype not in (torch.float32, torch.bfloat16)):
            return False
        if plan.prefill and not self._prefill_ok:
            return False
        return all(g.suffix.rows.shape[0] <= self._cascade_seqs for g in plan.shared)

    def run(self, hidden: torch.Tensor, cos_sin: tuple[torch.Tensor, torch.Tensor] | None,
            slot_mapping: torch.Tensor, block_tables: torch.Tensor, plan: AttentionPlan,
            kv_caches: Sequence[tuple[torch.Tensor, torch.Tensor]]) -> torch.Tensor:
        """Run every layer over ``hidden [T, H]`` (fp32, dense; overwritten) and return it.

        ``cos_sin``: the RoPE table rows ``[T, 1, D/2]`` each (contiguous), or None;
        ``slot_mapping [T]`` int64; ``block_tables [S, max_pages]`` (the pages of the
        sequences with several new rows are read from it); ``plan`` the step's attention plan
        (:meth:`accepts` it).

        Raises:
            ValueError: inputs that do not fit together, or a slot, page id, row or length out
                of range (found before anything is written: the pool is untouched).
            MemoryError: a kernel could not allocate its scratch.
        """
        rows = hidden.shape[0]
        if (plan.starts[-1] != rows or slot_mapping.shape != (rows,)
                or slot_mapping.dtype != torch.int64 or not slot_mapping.is_contiguous()
                or hidden.dtype != torch.float32 or not hidden.is_contiguous()
                or hidden.shape[1] != self._hidden):
            raise ValueError(f"decode step: hidden {tuple(hidden.shape)}, slots "
                             f"{tuple(slot_mapping.shape)} ({slot_mapping.dtype}) and a plan of "
                             f"{plan.starts[-1]} rows do not fit together")
        caches = self._cache_pointers(kv_caches)
        k_cache = kv_caches[0][0]
        work = self._buffers(rows)
        groups, keep = self._groups(plan, block_tables, k_cache.shape[1])
        num_pages = k_cache.shape[0]
        self._model.page_size = k_cache.shape[1]
        self._model.kv_bf16 = int(k_cache.dtype == torch.bfloat16)
        cos, sin = (None, None) if cos_sin is None else (cos_sin[0].data_ptr(),
                                                         cos_sin[1].data_ptr())
        rc = self._function(
            ctypes.byref(self._model), caches, num_pages, hidden.data_ptr(),
            *(buffer.data_ptr() for buffer in work), rows, cos, sin, slot_mapping.data_ptr(),
            groups, len(groups), torch.get_num_threads(),
        )
        del keep
        if rc == -2:
            raise ValueError(f"decode step: a slot, page id, row or length outside the pool of "
                             f"{num_pages} pages or the step's {rows} rows (nothing written)")
        if rc == -3:
            raise MemoryError("decode step: a kernel could not allocate its scratch")
        if rc != 0:
            raise RuntimeError(f"decode step failed ({rc})")
        return hidden

    def _buffers(self, rows: int) -> list[torch.Tensor]:
        """spare [T, H], x [T, H], qkv [T, Q + 2KV], attn [T, Q], gate_up [T, 2I], act [T, I]:
        views of one workspace, grown to the largest step seen."""
        widths = (self._hidden, self._hidden, self._q + 2 * self._kv, self._q, 2 * self._inter,
                  self._inter)
        need = rows * sum(widths)
        if self._workspace.numel() < need:
            self._workspace = torch.empty(need, dtype=torch.float32)
        views, start = [], 0
        for width in widths:
            views.append(self._workspace[start: start + rows * width])
            start += rows * width
        return views

    def _cache_pointers(self, kv_caches: Sequence[tuple[torch.Tensor, torch.Tensor]]):
        """The 2L cache pointers, rebuilt (and the pool's layout checked) when the pool
        changes: one pair per layer, dense ``[num_pages, page_size, Hkv, D]`` fp32 or bf16,
        all alike (the kernels index them with the model's sizes)."""
        first = kv_caches[0][0] if kv_caches else None
        pointers = tuple(t.data_ptr() for pair in kv_caches for t in pair)
        key = (pointers, None if first is None else (tuple(first.shape), first.dtype))
        if key == self._caches:
            return self._cache_ptrs
        heads = (self._model.num_kv_heads, self._head_dim)
        if (first is None or len(kv_caches) != self._model.num_layers
                or first.dtype not in (torch.float32, torch.bfloat16)
                or first.dim() != 4 or tuple(first.shape[2:]) != heads
                or any(t.shape != first.shape or t.dtype != first.dtype or not t.is_contiguous()
                       or t.device.type != "cpu" for pair in kv_caches for t in pair)):
            raise ValueError(f"decode step: {len(kv_caches)} K/V cache pairs do not fit "
                             f"{self._model.num_layers} layers of {heads[0]} KV heads x "
                             f"{heads[1]} (dense fp32 or bf16 pages on the CPU)")
        self._caches = key
        self._cache_ptrs = (ctypes.c_void_p * len(pointers))(*pointers)
        return self._cache_ptrs

    def _groups(self, plan: AttentionPlan, block_tables: torch.Tensor, page_size: int
                ) -> tuple[ctypes.Array, list[torch.Tensor]]:
        groups, keep = [], []
        for s in plan.prefill:  # as the per-op path: the pages holding its context, as int64
            ctx_len, first = plan.lens[s], plan.starts[s]
            pages = block_tables[s, : -(-ctx_len // page_size)].long()
            keep.append(pages)
            groups.append(_Group(pages=pages.data_ptr(), max_pages=pages.shape[0],
                                 prefill_rows=plan.starts[s + 1] - first, ctx_len=ctx_len,
                                 first_row=first))
        for chunk in plan.padded:
            groups.append(_Group(rows=chunk.rows.data_ptr(), pages=chunk.pages.data_ptr(),
                                 max_pages=chunk.pages.shape[1],
                                 lengths=chunk.lengths.data_ptr(),
                                 num_seqs=chunk.rows.shape[0]))
        for shared in plan.shared:
            suffix = shared.suffix
            own_lse = torch.empty(suffix.rows.shape[0], self._heads, dtype=torch.float32)
            keep.append(own_lse)
            groups.append(_Group(rows=suffix.rows.data_ptr(), pages=suffix.pages.data_ptr(),
                                 max_pages=suffix.pages.shape[1],
                                 lengths=suffix.lengths.data_ptr(),
                                 num_seqs=suffix.rows.shape[0], shared_len=shared.shared_len,
                                 shared_pages=shared.shared_pages.data_ptr(),
                                 n_shared_pages=shared.shared_pages.shape[0],
                                 own_lse=own_lse.data_ptr()))
        return (_Group * len(groups))(*groups), keep


def bind_dense_decode_step(
    layers: Sequence[DenseLayerOps], rope: object | None, *, hidden: int, num_heads: int,
    num_kv_heads: int, head_dim: int, eps: float, scale: float,
) -> DenseDecodeStep | None:
    """The whole-step decode of these layers, or None when any op is not one the native step
    runs (see the module docstring) or the library lacks it here.

    ``rope``: the model's bound rotation, which every layer with ``rotate`` uses (None: no
    layer rotates)."""
    lib = library()
    if (lib is None or not layers or (rope is None and any(layer.rotate for layer in layers))
            or num_heads // num_kv_heads > lib.max_group or head_dim > lib.max_head_dim
            or (rope is not None and not isinstance(rope, NativeRope))):
        return None
    descriptors, keep = [], []
    inter = None
    for layer in layers:
        norms = (layer.input_norm, layer.mlp_norm)
        linears = [_linear_op(op) for op in (layer.qkv, layer.o, layer.gate_up, layer.down)]
        if (not all(isinstance(norm, NativeRMSNorm) for norm in norms)
                or not isinstance(layer.act, NativeSiluMul) or any(op is None for op in linears)
                or not (layer.qk_norm is None or isinstance(layer.qk_norm, NativeHeadNorm))):
            return None
        qk_norm = (None, None)
        if layer.qk_norm is not None:
            head_norm = layer.qk_norm
            if head_norm._heads != (num_heads, num_kv_heads, head_dim) or head_norm._eps != eps:
                return None
            qk_norm = head_norm._pointers
        qkv, o, gate_up, down = linears
        inter = down.k if inter is None else inter
        q, kv = num_heads * head_dim, num_kv_heads * head_dim
        if ((qkv.n, qkv.k, o.n, o.k, gate_up.n, gate_up.k, down.n, down.k)
                != (q + 2 * kv, hidden, hidden, q, 2 * inter, hidden, hidden, inter)
                or norms[0]._eps != eps or norms[1]._eps != eps):
            return None
        descriptors.append(_Layer(input_norm=norms[0]._weight_ptr, mlp_norm=norms[1]._weight_ptr,
                                  rotate=int(layer.rotate), q_norm=qk_norm[0],
                                  k_norm=qk_norm[1], qkv=qkv, o=o, gate_up=gate_up, down=down))
        keep += [*norms, layer.qkv, layer.o, layer.gate_up, layer.down, layer.qk_norm]
    array = (_Layer * len(descriptors))(*descriptors)
    model = _Model(num_layers=len(descriptors), hidden=hidden, num_heads=num_heads,
                   num_kv_heads=num_kv_heads, head_dim=head_dim, inter=inter, eps=eps,
                   scale=scale, layers=array)  # page size and K/V dtype: per call, from the pool
    sizes = (hidden, num_heads * head_dim, num_kv_heads * head_dim, inter, num_heads, head_dim)
    return DenseDecodeStep(model, array, keep, sizes)


__all__ = ["DenseDecodeStep", "DenseLayerOps", "bind_dense_decode_step"]
