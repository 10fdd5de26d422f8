"""The model runner: turns one scheduler step (chunks of sequences) into one forward pass.

The scheduler (no torch) hands over :class:`RunnerChunk` records (its ``ScheduledChunk``s, or
:class:`SeqChunk` for direct callers): which tokens of which sequence, where they sit
(``start_pos``) and the sequence's block table. The runner builds the flat
batch as plain Python lists and makes ONE tensor copy of each (nano-vllm style), runs the
copy-on-write page copies first, then the model, and returns the logits of the chunks that
sample.
"""

from __future__ import annotations

import dataclasses
import logging
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Protocol

import torch

from prefixgate import kernels
from prefixgate.engine.config import EngineConfig
from prefixgate.engine.kv_budget import (
    default_state_slots,
    num_paged_layers,
    plan_kv_budget,
    resolve_device,
    resolve_dtype,
    resolve_kv_dtype,
)
from prefixgate.engine.loader.loaded_model import LoadedModel
from prefixgate.engine.model_config import ModelConfig
from prefixgate.engine.models import ForwardBatch, build_model
from prefixgate.engine.models.forward_batch import RecurrentBatch
from prefixgate.engine.models.moe import StackedExperts
from prefixgate.engine.models.qwen3_5 import RecurrentState
from prefixgate.engine.precision import cpu_bf16_isa, cpu_int8_isa, is_q8
from prefixgate.kernels.cpu.host_memory import huge_pages_status
from prefixgate.kernels.quant import QuantizedTensor

logger = logging.getLogger(__name__)


class RunnerChunk(Protocol):
    """What the runner reads of a chunk (:class:`SeqChunk` documents the fields)."""

    @property
    def token_ids(self) -> Sequence[int]: ...

    @property
    def start_pos(self) -> int: ...

    @property
    def block_table(self) -> Sequence[int]: ...

    @property
    def need_logits(self) -> bool: ...

    @property
    def num_logits(self) -> int: ...


@dataclass(frozen=True, slots=True)
class ChunkState:
    """A hybrid model's state work for one chunk (cache/state_slots.py decides it).

    ``slot``: the sequence's working state slot (read, then updated by the step);
    ``restore``: before the forward, the working slot is set from this checkpoint slot
    (``ZERO_STATE``: zeroed; None: kept); ``saves``: ``(row, slot)``, checkpoint the state after
    the chunk's row ``row`` (0-based) into ``slot``.
    """

    slot: int
    restore: int | None = None
    saves: tuple[tuple[int, int], ...] = ()


ZERO_STATE = -1  # ChunkState.restore: a fresh sequence starts from the zero state


@dataclass(frozen=True, slots=True)
class SeqChunk:
    """Some consecutive tokens of one sequence to run this step.

    ``token_ids`` occupy positions ``start_pos .. start_pos + len - 1``; ``start_pos`` tokens of
    the sequence are already in the cache. ``block_table`` maps the sequence's logical blocks
    to physical pages and covers every position up to the chunk's end. ``need_logits``: return
    the next-token logits after the chunk's last token.
    """

    token_ids: Sequence[int]
    start_pos: int
    block_table: Sequence[int]
    need_logits: bool = True
    # logits of the chunk's last ``num_logits`` positions (> 1: a speculative verify chunk)
    num_logits: int = 1
    state: ChunkState | None = None  # hybrid models only


def _configure_cpu_threads() -> None:
    # torch sizes its pool by the machine's cores; a container/cgroup may grant fewer, and
    # oversubscribed OpenMP threads spin against each other
    available = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    if available and torch.get_num_threads() > available:
        torch.set_num_threads(available)


class ModelRunner:
    """Owns the model weights on the device and the KV pool; executes steps.

    Args:
        config: the model's shape.
        weights: HF-named weights (``LoadedModel.weights``).
        settings: the engine's settings (engine/config.py documents each field); the
            runner reads ``device``, ``dtype``, ``kv_dtype``, ``page_size``, ``num_pages`` /
            ``kv_memory_gb`` (neither: the default budget), ``max_model_len``,
            ``kernel_backend``, ``native_kernels``, ``quantized_weights`` and
            ``num_state_slots`` (None: ``kv_budget.default_state_slots``). None = the defaults.
        kv_pool: an existing ``[L, 2, P, page_size, Hkv, D]`` pool instead of a new one (its
            dtype is the KV dtype unless ``settings.kv_dtype`` names one).
        eos_token_ids: exposed for the engine (the tokenizer's).
        shared_prefix_attention: torch backend: decode rows whose contexts start with the same
            pages attend to that run once for all of them (kernels/attention_plan.py).
    """

    def __init__(
        self,
        config: ModelConfig,
        weights: Mapping[str, torch.Tensor],
        settings: EngineConfig | None = None,
        *,
        kv_pool: torch.Tensor | None = None,
        eos_token_ids: Sequence[int] = (),
        shared_prefix_attention: bool = True,
    ) -> None:
        settings = settings or EngineConfig()
        if settings.max_model_len is not None and settings.max_model_len < 1:
            raise ValueError(f"max_model_len must be >= 1, got {settings.max_model_len}")
        kv_dtype = kv_pool.dtype if kv_pool is not None and settings.kv_dtype is None else settings.kv_dtype
        self._set_precision(settings.device, settings.dtype, kv_dtype)
        self.config = config
        self.max_model_len = min(config.max_position_embeddings, settings.max_model_len or 1 << 62)
        self.eos_token_ids = tuple(eos_token_ids)
        # the backend is chosen here, once: every step and layer uses this object
        self.kernel_backend = kernels.resolve_backend(self.device, settings.kernel_backend)
        self.native_kernels_requested = settings.native_kernels  # (kernel_report: off by request?)
        self.native_cpu_kernels = settings.native_kernels and self._native_cpu_kernels_apply()
        self._check_int8_mode(weights, settings.quantized_weights)
        self.model = build_model(
            config, weights, device=self.device, dtype=self.dtype,
            max_positions=self.max_model_len, kernel_backend=self.kernel_backend,
            native_ops=self.native_cpu_kernels, quantized_weights=settings.quantized_weights,
            int8_activations=self.int8_isa is not None, whole_step=settings.native_decode_step,
        )
        self.shared_prefix_attention = shared_prefix_attention
        self.page_size = settings.page_size
        self.kv_pool = self._kv_pool(kv_pool, settings.num_pages, settings.kv_memory_gb)  # [L, 2, P, ps, Hkv, D]
        self.num_pages = int(self.kv_pool.shape[2])
        # per layer: (K, V) of the paged layers; a hybrid model's linear layers: a state pool
        self.num_state_slots = settings.num_state_slots or default_state_slots(
            config, settings.max_num_seqs, settings.kv_memory_gb)
        self.states = self._state_pools(self.num_state_slots)
        self._kv_caches = self._layer_caches()
        self.attention = kernels.create_backend(
            self.kernel_backend, self.kv_pool, native=self.native_cpu_kernels,
            share_prefixes=shared_prefix_attention,
        )
        # after the pool and the weights were allocated: a refused advice shows here
        self.huge_pages = huge_pages_status() if self.device.type == "cpu" else None
        self._log_start()

    @property
    def is_hybrid(self) -> bool:
        """Whether the model keeps recurrent state (and so needs state slots per chunk)."""
        return bool(self.states)

    def _state_pools(self, num_slots: int) -> list[RecurrentState]:
        """One :class:`RecurrentState` per linear layer (none for attention-only models)."""
        linear = self.config.linear_attention
        if linear is None:
            return []
        if num_slots < 1:
            raise ValueError(f"num_state_slots must be >= 1, got {num_slots}")
        conv = (num_slots, linear.conv_kernel - 1, linear.conv_channels)
        matrix = (num_slots, linear.num_value_heads, linear.key_dim, linear.value_dim)
        return [
            RecurrentState(torch.zeros(conv, device=self.device), torch.zeros(matrix, device=self.device))
            for _ in range(sum(linear.layers))
        ]

    def _layer_caches(self) -> list[object]:
        """What each layer of ``forward`` reads: its (K, V) pages or its state pool."""
        linear = self.config.linear_attention
        paged = iter([(layer[0], layer[1]) for layer in self.kv_pool])
        states = iter(self.states)
        kinds = linear.layers if linear is not None else [False] * self.config.num_layers
        return [next(states) if is_linear else next(paged) for is_linear in kinds]

    def _set_precision(self, device: str | torch.device | None, dtype: str | torch.dtype | None,
                       kv_dtype: str | torch.dtype | None) -> None:
        """Device, weight/activation dtype and KV dtype (``__init__`` documents the defaults)."""
        self.device = resolve_device(device)
        # the instructions the q8 mode's products run on (None: not that mode); fp32 otherwise
        self.int8_isa = cpu_int8_isa(self.device) if is_q8(dtype) else None
        self.dtype = resolve_dtype("fp32" if self.int8_isa else dtype, self.device)
        self.kv_dtype = resolve_kv_dtype(kv_dtype, self.dtype)
        # the instructions the CPU bf16 mode's GEMMs run on (None: not that mode)
        cpu_bf16 = self.device.type == "cpu" and self.dtype == torch.bfloat16
        self.bf16_isa = cpu_bf16_isa() if cpu_bf16 else None
        if self.device.type == "cpu":
            _configure_cpu_threads()

    def _check_int8_mode(self, weights: Mapping[str, object], quantized_weights: bool) -> None:
        """The q8 mode refuses, before the weights are placed, to run as the plain fp32 mode
        under another name: without the native kernels or without ggml blocks to run."""
        if self.int8_isa is None:
            return
        blocks = any(isinstance(w, QuantizedTensor | StackedExperts) for w in weights.values())
        why = ("the native CPU kernels are off (--native-kernels off, or another kernel backend)"
               if not self.native_cpu_kernels else
               "--quantized-weights is off" if not quantized_weights else
               None if blocks else f"{self.config.name} has no Q4_0/Q4_1/Q8_0 matrices")
        if why is not None:
            raise ValueError(f"dtype q8 runs a GGUF's integer blocks on int8 activations, but "
                             f"{why}; use --dtype fp32 or bf16")

    def _native_cpu_kernels_apply(self) -> bool:
        """fp32 (or the bf16 mode's fp32 activations) on CPU: decode attention and the fused
        layer ops run natively when the library builds here (kernels/cpu/decode.py, ops.py)."""
        return (
            self.device.type == "cpu"
            and self.dtype in (torch.float32, torch.bfloat16)
            and kernels.backend_spec(self.kernel_backend).native_cpu
            and kernels.native_decode_available()
        )

    def _log_start(self) -> None:
        logger.info(
            "runner: %s on %s/%s%s, %d pages x %d tokens (%.2f GiB KV, %s), kernels=%s%s%s",
            self.config.name,
            self.device,
            self.dtype,
            f" (fp32 activations, GEMMs on {self.bf16_isa})" if self.bf16_isa else
            f" (GGUF blocks x int8 activations on {self.int8_isa})" if self.int8_isa else "",
            self.num_pages,
            self.page_size,
            self.kv_pool.numel() * self.kv_pool.element_size() / (1 << 30),
            self.kv_dtype,
            self.kernel_backend,
            " + native CPU kernels" if self.native_cpu_kernels else "",
            f", huge pages {self.huge_pages}" if self.huge_pages else "",
        )

    def _kv_pool(self, kv_pool: torch.Tensor | None, num_pages: int | None,
                 kv_memory_gb: float | None) -> torch.Tensor:
        """The given pool, checked against the model, or a new one of the budgeted size."""
        config = self.config
        shape_tail = (self.page_size, config.num_kv_heads, config.head_dim)
        if kv_pool is not None:
            expected = (num_paged_layers(config), 2, kv_pool.shape[2], *shape_tail)
            if (
                tuple(kv_pool.shape) != expected
                or kv_pool.device != self.device
                or kv_pool.dtype != self.kv_dtype
            ):
                raise ValueError(
                    f"kv_pool has shape {tuple(kv_pool.shape)} {kv_pool.dtype} on "
                    f"{kv_pool.device}; expected {expected} {self.kv_dtype} on {self.device}"
                )
            return kv_pool
        budget = plan_kv_budget(
            config,
            page_size=self.page_size,
            dtype=self.kv_dtype,
            device=self.device,
            num_pages=num_pages,
            kv_memory_gb=kv_memory_gb,
        )
        return kernels.allocate_kv_pool(
            num_paged_layers(config),
            budget.num_pages,
            self.page_size,
            config.num_kv_heads,
            config.head_dim,
            self.kv_dtype,
            self.device,
        )

    @classmethod
    def from_loaded(cls, loaded: LoadedModel, settings: EngineConfig | None = None, *,
                    kv_pool: torch.Tensor | None = None, shared_prefix_attention: bool = True,
                    **fields: object) -> ModelRunner:
        """A runner for a loaded model; EOS ids come from its tokenizer.

        Args:
            settings: the engine's settings (None: the defaults).
            fields: ``EngineConfig`` fields that replace those of ``settings`` (tests and
                benchmarks: ``from_loaded(loaded, num_pages=8, dtype="bf16")``); validated by
                the config as any other.
        """
        settings = dataclasses.replace(settings or EngineConfig(), **fields)  # type: ignore[arg-type]
        return cls(loaded.config, loaded.weights, settings, kv_pool=kv_pool,
                   eos_token_ids=loaded.tokenizer.eos_token_ids,
                   shared_prefix_attention=shared_prefix_attention)

    @property
    def vocab_size(self) -> int:
        return self.config.vocab_size

    @property
    def attention_context_scale(self) -> int:
        """See ``ModelConfig.attention_context_scale`` (the scheduler's chunk cost unit)."""
        return self.config.attention_context_scale

    def _tensor(self, values: list[int], dtype: torch.dtype) -> torch.Tensor:
        if self.device.type == "cpu":
            return torch.tensor(values, dtype=dtype)
        # pinned host staging lets the copy overlap with whatever the GPU is still doing
        return torch.tensor(values, dtype=dtype, pin_memory=True).to(self.device, non_blocking=True)

    def _copy_pages(self, copy_pairs: Sequence[tuple[int, int]]) -> None:
        src = [int(s) for s, _ in copy_pairs]
        dst = [int(d) for _, d in copy_pairs]
        for page in (*src, *dst):
            if not 0 <= page < self.num_pages:
                raise ValueError(f"copy pair page id {page} outside the pool [0, {self.num_pages})")
        if len(set(dst)) != len(dst) or set(dst) & set(src):
            raise ValueError(
                f"copy pairs need distinct destinations disjoint from the sources: {copy_pairs}"
            )
        self.attention.copy_pages(self._tensor(src, torch.int64), self._tensor(dst, torch.int64))

    def _chunk_pages(self, index: int, chunk: RunnerChunk) -> Sequence[int]:
        """The pages ``chunk`` uses, after checking it fits the model and the pool."""
        count, start = len(chunk.token_ids), chunk.start_pos
        end = start + count
        if count == 0:
            raise ValueError(f"chunk {index} has no tokens")
        if start < 0:
            raise ValueError(f"chunk {index}: start_pos must be >= 0, got {start}")
        if end > self.max_model_len:
            raise ValueError(
                f"chunk {index} reaches position {end}, past max_model_len {self.max_model_len}"
            )
        used_pages = (end + self.page_size - 1) // self.page_size
        table = chunk.block_table
        if len(table) < used_pages:
            raise ValueError(
                f"chunk {index}: block table has {len(table)} pages, positions up to {end} "
                f"need {used_pages}"
            )
        table = table[:used_pages]
        if min(table) < 0 or max(table) >= self.num_pages:
            raise ValueError(
                f"chunk {index}: block table page ids must be in [0, {self.num_pages}), "
                f"got {list(table)}"
            )
        if chunk.need_logits and not 1 <= chunk.num_logits <= count:
            raise ValueError(f"chunk {index}: num_logits must be in [1, {count}], "
                             f"got {chunk.num_logits}")
        return table

    def _build_batch(self, chunks: Sequence[RunnerChunk]) -> ForwardBatch:
        page_size = self.page_size
        input_ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        seq_lens: list[int] = []
        query_start_loc = [0]
        logits_indices: list[int] = []
        tables = [self._chunk_pages(index, chunk) for index, chunk in enumerate(chunks)]
        for chunk, table in zip(chunks, tables, strict=True):
            count, start = len(chunk.token_ids), chunk.start_pos
            end = start + count
            input_ids.extend(chunk.token_ids)
            positions.extend(range(start, end))
            # slots page by page: one range per page instead of one division per token
            for block in range(start // page_size, len(table)):
                base = table[block] * page_size
                lo = max(start, block * page_size) - block * page_size
                hi = min(end, (block + 1) * page_size) - block * page_size
                slots.extend(range(base + lo, base + hi))
            seq_lens.append(end)
            query_start_loc.append(query_start_loc[-1] + count)
            if chunk.need_logits:
                logits_indices.extend(range(query_start_loc[-1] - chunk.num_logits, query_start_loc[-1]))
        max_query_len = max(len(c.token_ids) for c in chunks)
        width = max(len(t) for t in tables)
        flat_tables: list[int] = []
        for table in tables:
            flat_tables.extend(table)
            # NOTE: entries past a sequence's last page are ignored by the kernels; 0 is in range
            flat_tables.extend([0] * (width - len(table)))
        recurrent = self._recurrent_batch(chunks, query_start_loc) if self.states else None
        slot_mapping = self._tensor(slots, torch.int64)
        block_tables = self._tensor(flat_tables, torch.int32).view(len(tables), width)
        seq_lens_tensor = self._tensor(seq_lens, torch.int32)
        starts = self._tensor(query_start_loc, torch.int32)
        inputs = kernels.AttentionInputs(tables, seq_lens, query_start_loc, max_query_len,
                                         slot_mapping, block_tables, seq_lens_tensor, starts)
        return ForwardBatch(
            input_ids=self._tensor(input_ids, torch.int64),
            positions=self._tensor(positions, torch.int64),
            slot_mapping=slot_mapping,
            block_tables=block_tables,
            seq_lens=seq_lens_tensor,
            query_start_loc=starts,
            logits_indices=self._tensor(logits_indices, torch.int64),
            max_query_len=max_query_len,
            # every layer reads the same addressing: the backend sorts it out once per step
            attention=self.attention.prepare_metadata(inputs),
            recurrent=recurrent,
        )

    def _recurrent_batch(self, chunks: Sequence[RunnerChunk], query_start_loc: list[int]) -> RecurrentBatch:
        """The state slots of a hybrid model's step, checked like the pages are."""
        num_slots = int(self.states[0].conv.shape[0])
        slots: list[int] = []
        save_rows: list[int] = []
        save_slots: list[int] = []
        for index, chunk in enumerate(chunks):
            state = getattr(chunk, "state", None)
            if state is None:
                raise ValueError(f"chunk {index}: a hybrid model's chunk needs a state slot")
            used = [state.slot, *(slot for _, slot in state.saves)]
            if state.restore not in (None, ZERO_STATE):
                used.append(state.restore)
            if min(used) < 0 or max(used) >= num_slots:
                raise ValueError(f"chunk {index}: state slots must be in [0, {num_slots}), got {used}")
            for row, slot in state.saves:
                if not 0 <= row < len(chunk.token_ids):
                    raise ValueError(f"chunk {index}: save row {row} outside its {len(chunk.token_ids)} rows")
                save_rows.append(query_start_loc[index] + row)
                save_slots.append(slot)
            slots.append(state.slot)
        targets = slots + save_slots
        if len(set(targets)) != len(targets):
            raise ValueError(f"state slots written twice in one step: {targets}")
        return RecurrentBatch(self._tensor(slots, torch.int64), list(query_start_loc), save_rows,
                              self._tensor(save_slots, torch.int64))

    @torch.inference_mode()
    def copy_states(self, pairs: Sequence[tuple[int, int]]) -> None:
        """Copy state slot ``src`` into ``dst`` in every linear layer (a fork's child)."""
        for src, dst in pairs:
            for pool in self.states:
                for tensor in (pool.conv, pool.matrix):
                    tensor[dst] = tensor[src]

    def _restore_states(self, chunks: Sequence[RunnerChunk]) -> None:
        """Set each restoring chunk's working slot from its checkpoint (or zero) before the
        forward: re-run safely, since the checkpoint is not what the step writes."""
        for chunk in chunks:
            state = getattr(chunk, "state", None)
            if state is None or state.restore is None:
                continue
            for pool in self.states:
                for tensor in (pool.conv, pool.matrix):
                    if state.restore == ZERO_STATE:
                        tensor[state.slot].zero_()
                    else:
                        tensor[state.slot] = tensor[state.restore]

    @torch.inference_mode()
    def execute(
        self, chunks: Sequence[RunnerChunk], copy_pairs: Sequence[tuple[int, int]] = ()
    ) -> torch.Tensor:
        """Run one step.

        Args:
            chunks: the step's work, any mix of prefill chunks and single decode tokens (each
                sequence at most once).
            copy_pairs: copy-on-write ``(src_page, dst_page)`` copies, done BEFORE the forward.

        Returns:
            ``[sum of num_logits over chunks with need_logits, vocab]`` fp32 logits on the
            runner's device, in chunk order.

        Raises:
            ValueError: a malformed chunk (empty, block table too short, page id out of range,
                past max_model_len) or copy pair; nothing has run when this is raised.
        """
        if not chunks:
            raise ValueError("execute() needs at least one chunk")
        batch = self._build_batch(chunks)  # validates everything before any side effect
        if copy_pairs:
            self._copy_pages(copy_pairs)
        if self.states:
            self._restore_states(chunks)
        return self.model.forward(batch, self._kv_caches)
