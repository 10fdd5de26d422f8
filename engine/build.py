"""Build an engine from an EngineConfig: load weights, size the KV pool, wire the parts."""

from __future__ import annotations

import dataclasses
import logging
import os
from typing import Any

from prefixgate.cache import KVCacheManager, StateSlots
from prefixgate.cache.events import EventSink
from prefixgate.cache.tier import HostTier, TierStore, entry_slot_bytes
from prefixgate.engine.config import (
    AUTO_TIER_RAM_FRACTION,
    EngineConfig,
    auto_tier_bytes,
    decode_slowdown,
)
from prefixgate.engine.drafter import NgramDrafter
from prefixgate.engine.engine_core import LLMEngine
from prefixgate.engine.kv_tier import KVTier
from prefixgate.engine.loader import LoadedModel, load_model
from prefixgate.engine.model_config import parse_rope_override, with_rope_override
from prefixgate.engine.runner import ModelRunner
from prefixgate.engine.scheduler import Scheduler
from prefixgate.engine.step_budget import step_budgets
from prefixgate.engine.step_pacing import StepPacer


def create_llm_engine(
    config: EngineConfig,
    *,
    loaded: LoadedModel | None = None,
    event_sink: EventSink | None = None,
    progress: bool | None = None,
    tier_store: TierStore | None = None,
) -> tuple[LLMEngine, dict[str, Any]]:
    """Load the model (unless ``loaded`` is given) and return the sync engine plus facts about it.

    Returns:
        (engine, info) with info keys model_name, device, dtype, kv_dtype, kernel_backend,
        native_cpu_kernels, huge_pages (CPU: whether the KV pool and weights sit in huge
        pages, kernels/cpu/host_memory.py; None on GPU), num_pages.
    """
    loaded = _load(config, loaded, progress)
    runner = _build_runner(config, loaded)
    loaded.tokenizer.parse_special_tokens = config.parse_special_tokens
    if tier_store is None:
        tier_store = _build_tier_store(config, runner)
    cache = KVCacheManager(runner.num_pages, runner.page_size,
                           enable_caching=config.enable_prefix_caching, watermark=config.watermark,
                           hash_seed=config.hash_seed, event_sink=event_sink,
                           state_slots=_state_slots(runner, config))
    engine = LLMEngine(runner, loaded.tokenizer, config, _build_scheduler(config, runner, cache),
                       model_id=loaded.name)
    if tier_store is not None:
        # the second tier: evicted cached pages are spilled there and loaded back on a hit
        engine.attach_tier(KVTier(tier_store, runner.kv_pool))
    return engine, _engine_info(config, loaded, runner)


def _state_slots(runner: ModelRunner, config: EngineConfig) -> StateSlots | None:
    """A hybrid model's state group over the runner's slots (None for other models)."""
    if not getattr(runner, "is_hybrid", False):
        return None
    return StateSlots(runner.num_state_slots, config.state_checkpoint_every)


def _build_scheduler(config: EngineConfig, runner: ModelRunner, cache: KVCacheManager) -> Scheduler:
    device_type = runner.device.type
    max_model_len = min(config.max_model_len or runner.max_model_len, runner.max_model_len)
    return Scheduler(
        cache, config,
        # CPU steps are compute-bound: a chunk's attention counts by the model's
        # attention-vs-linear FLOP ratio (step_budget.step_budgets)
        budgets=step_budgets(config, device_type, runner.attention_context_scale),
        # NOTE: not for hybrid models: a rejected draft would have advanced their
        # recurrent state, which (unlike K/V past num_computed) cannot be rolled back
        drafter=(NgramDrafter(config.num_speculative_tokens, max_model_len)
                 if config.num_speculative_tokens and cache.state is None else None),
        pacer=_build_pacer(config, device_type),
    )


def _build_pacer(config: EngineConfig, device_type: str) -> StepPacer | None:
    slowdown = decode_slowdown(config, device_type)
    if slowdown is None:
        return None
    log.info("step pacing: a step with decodes is held to %gx the decodes' own step", slowdown)
    return StepPacer(slowdown)


def _load(config: EngineConfig, loaded: LoadedModel | None, progress: bool | None) -> LoadedModel:
    """The model's weights and tokenizer, with the configured RoPE override applied."""
    if loaded is None:
        loaded = load_model(config.model, progress=progress)
    if config.rope_scaling is not None:
        stretched = with_rope_override(loaded.config, *parse_rope_override(config.rope_scaling))
        loaded = dataclasses.replace(loaded, config=stretched)
    return loaded


def _build_runner(config: EngineConfig, loaded: LoadedModel) -> ModelRunner:
    return ModelRunner.from_loaded(loaded, config)


log = logging.getLogger(__name__)


def _build_tier_store(config: EngineConfig, runner: ModelRunner) -> TierStore | None:
    """The configured second tier when the caller gave none (the server passes Redis's)."""
    page_bytes = runner.kv_pool[:, :, 0].numel() * runner.kv_pool.element_size()
    if config.kv_tier == "auto":
        available = available_ram_bytes()
        size = auto_tier_bytes(available, config.kv_tier_size_gb, page_bytes * runner.num_pages)
        gib = 1 << 30
        log.info("KV tier (auto): %s (%.0f%% of %.1f GiB RAM available, cap %.1f GiB)",
                 f"host, {size / gib:.2f} GiB" if size else "off", AUTO_TIER_RAM_FRACTION * 100,
                 (available or 0) / gib, config.kv_tier_size_gb)
        if not size:
            return None
        return HostTier(size, entry_slot_bytes(page_bytes), path=config.kv_tier_path)
    if config.kv_tier == "host":
        return HostTier(int(config.kv_tier_size_gb * (1 << 30)), entry_slot_bytes(page_bytes),
                        path=config.kv_tier_path)
    if config.kv_tier == "redis":
        raise ValueError("kv_tier redis needs the server's Redis store (--redis-url)")
    return None


def available_ram_bytes() -> int | None:
    """RAM this process could still take without swapping: the kernel's ``MemAvailable``, or
    less when a container's memory limit (cgroup v2 or v1) leaves less; None if unknown.

    NOTE: inside a container /proc/meminfo shows the host's memory, so a tier sized from it
    alone could push a limited container into the OOM killer."""
    available = _meminfo_available()
    for limit_file, usage_file in (("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory.current"),
                                   ("/sys/fs/cgroup/memory/memory.limit_in_bytes",
                                    "/sys/fs/cgroup/memory/memory.usage_in_bytes")):
        limit, usage = _read_int(limit_file), _read_int(usage_file)
        if limit is not None and usage is not None and limit < (1 << 60):
            left = max(limit - usage, 0)
            available = left if available is None else min(available, left)
            break
    return available


def _meminfo_available() -> int | None:
    try:
        with open("/proc/meminfo") as meminfo:
            for line in meminfo:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        return None


def _read_int(path: str) -> int | None:
    """The integer in a one-line file ("max" and unreadable files: None)."""
    try:
        with open(path) as f:
            return int(f.read().strip())
    except (OSError, ValueError):
        return None


def _engine_info(config: EngineConfig, loaded: LoadedModel, runner: ModelRunner) -> dict[str, Any]:
    return {
        "model_name": config.served_model_name or default_served_name(loaded),
        "model_id": loaded.name,
        "device": str(runner.device),
        "dtype": "q8" if runner.int8_isa else str(runner.dtype).removeprefix("torch."),
        "kv_dtype": str(runner.kv_dtype).removeprefix("torch."),
        "kernel_backend": runner.kernel_backend,
        "native_cpu_kernels": runner.native_cpu_kernels,
        "huge_pages": runner.huge_pages,
        "num_pages": runner.num_pages,
    }


def default_served_name(loaded: LoadedModel) -> str:
    """What clients pass as ``model``: the file's stem without its quant suffix
    (``SmolLM2-135M-Instruct.Q4_1.gguf`` -> ``SmolLM2-135M-Instruct``), or the directory name.
    GGUF ``general.name`` values are often prose ("Smollm2 135M 8k Lc100K Mix1 Ep2")."""
    path = loaded.path
    if path.is_dir():
        return path.name
    return path.name.split(".")[0] or loaded.name
