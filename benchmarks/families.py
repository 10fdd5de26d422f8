"""Tokens/s of every model family at SmolLM2-135M's shape, per parameter, relative to SmolLM2.

Workload (every size is a flag):
  * models: each registered family configured at SmolLM2-135M-Instruct's shape (hidden 576,
    30 layers, 9 query / 3 KV heads of 64, MLP 1536, vocabulary 49,152, tied embeddings), with
    what the family adds: Qwen3's q/k norms; Gemma 3's sandwich and ``1 + w`` norms, GeGLU,
    embedding scale, softcapping and 5 sliding (``--window``) layers to 1 global; Phi-4-mini's
    partial rotary (0.75); Qwen3-MoE with 16 experts of width 384, top-4 (the active MLP is
    SmolLM2's width; total parameters 2.4x); SmolLM3's NoPE layers (every 4th without RoPE);
    Granite 3.x's four multipliers (3.3-2B's values); OLMo 2's post-norm blocks and q/k norms
    over whole projections; Qwen3.5's hybrid layers (3 Gated DeltaNet layers in 4: 4 q/k heads
    and 8 value heads of 64; gated attention with partial rotary in the 4th); gpt-oss's attention sinks, q/k/v/o biases, sliding (its 128)
    and full layers alternating, and Qwen3-MoE's expert shape with its biased router and
    clamped SwiGLU experts; ``gpt_oss_mxfp4`` the same with its expert matrices in MXFP4 blocks
    (as gpt-oss ships them: the native MXFP4 kernel, fp32 activations), against ``gpt_oss``
    (the expanded fp32 reference, same shape). Random fp32 weights (speed does not depend on
    the values; no download), CPU, fp32, the runner's defaults (native CPU kernels where the
    library builds). ``smollm2`` is the Llama family at that shape: the reference row.
  * prefill: one sequence of ``--prefill`` random token ids into an empty cache (one
    ``ModelRunner.execute``); decode: ``--batch`` sequences, each with a private copy of a
    ``--context``-token context, ``--steps`` greedy steps per sample.
  * paths: the native CPU kernels (the runner's default); with ``--torch-reference`` every
    family again on the torch reference path (``native_kernels=False``: torch norms, RoPE and
    attention, oneDNN GEMMs), each path's ratios against SmolLM2 on the same path.
  * timing: ``--threads`` torch threads (default 1), medians of ``--repeats`` samples after a
    warm-up, in CPU time of the process (``time.process_time``) as well as wall time: families
    run one after another (one model in memory at a time), and on a shared machine the wall
    time of one family against the next swings by multiples while the CPU time a step costs
    holds.

Reported per family: prefill and decode tokens per CPU second (and per wall second),
parameters (total; active for MoE), and ``per_param_vs_smollm2`` = (tokens per CPU second x
parameters) / SmolLM2's: 1.0 = as fast per parameter as the Llama path, lower = the family's
extras cost more than their share of the weights; ``per_active_param_vs_smollm2`` the same with
the parameters a token reads (an MoE's chosen experts only).

    python -m benchmarks.families --json out/families.json
    python -m benchmarks.families --families smollm2 gemma3 --prefill 256 --steps 4
    python -m benchmarks.families --families smollm3 granite olmo2 --torch-reference
    python -m benchmarks.families --families gpt_oss gpt_oss_mxfp4 --torch-reference
"""

from __future__ import annotations

import dataclasses
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch

from benchmarks.common import base_parser, print_table, write_json
from benchmarks.model import _OurDecode
from prefixgate.engine.config import EngineConfig
from prefixgate.engine.model_config import (
    LinearAttentionConfig,
    ModelConfig,
    expected_weight_shapes,
)
from prefixgate.engine.runner import ZERO_STATE, ChunkState, ModelRunner, SeqChunk
from prefixgate.kernels.torch_cpu.mxfp4 import Mxfp4Experts, quantize_mxfp4

FIRST_ORDINARY_TOKEN = 100

SMOLLM2 = ModelConfig(
    architecture="llama", name="smollm2", vocab_size=49152, hidden_size=576,
    intermediate_size=1536, num_layers=30, num_heads=9, num_kv_heads=3, head_dim=64,
    rms_norm_eps=1e-5, rope_theta=100000.0, max_position_embeddings=8192,
    tie_word_embeddings=True, attention_bias=False,
)  # fmt: skip


def _gemma3(window: int) -> dict[str, Any]:
    layers = tuple("full" if (i + 1) % 6 == 0 else "sliding" for i in range(SMOLLM2.num_layers))
    return {
        "architecture": "gemma3_text", "qk_norm": True, "norm_weight_offset": 1.0,
        "activation": "gelu_tanh", "embedding_scale": SMOLLM2.hidden_size**0.5,
        "sandwich_norms": True, "final_logit_softcapping": 30.0, "sliding_window": window,
        "layer_types": layers, "rope_local_theta": 10000.0,
    }  # fmt: skip


def family_configs(window: int) -> dict[str, ModelConfig]:
    """Every family at SmolLM2-135M's shape (the module docstring says what each adds)."""
    options: dict[str, dict[str, Any]] = {
        "smollm2": {},
        "llama3": {"rope_theta": 500000.0},
        "qwen3": {"architecture": "qwen3", "qk_norm": True},
        "qwen3_moe": {
            "architecture": "qwen3_moe", "qk_norm": True, "num_experts": 16,
            "num_experts_per_tok": 4, "moe_intermediate_size": 384,
        },
        "gemma3": _gemma3(window),
        "phi3": {"architecture": "phi3"},
        "phi4_mini": {"architecture": "phi3", "rotary_dim": 48},
        "smollm3": {
            "architecture": "smollm3",
            "rope_layers": tuple((i + 1) % 4 != 0 for i in range(SMOLLM2.num_layers)),
        },
        "granite": {
            "architecture": "granite", "embedding_scale": 12.0, "residual_scale": 0.22,
            "attention_multiplier": 0.015625, "logits_scaling": 8.0,
        },
        "olmo2": {
            "architecture": "olmo2", "qk_norm": True, "qk_norm_full": True, "pre_norms": False,
            "sandwich_norms": True,
        },
        "qwen3_5": {  # hybrid: 3 Gated DeltaNet layers in 4, gated attention in the 4th
            "architecture": "qwen3_5_text", "qk_norm": True, "norm_weight_offset": 1.0,
            "attn_output_gate": True, "rotary_dim": 16,
            "linear_attention": LinearAttentionConfig(
                layers=tuple((i + 1) % 4 != 0 for i in range(SMOLLM2.num_layers)),
                conv_kernel=4, num_key_heads=4, num_value_heads=8, key_dim=64, value_dim=64),
        },
        "gpt_oss": {  # sinks, biases, alternating sliding / full, biased clamped experts
            "architecture": "gpt_oss", "attention_bias": True, "attention_out_bias": True,
            "attention_sinks": True, "num_experts": 16, "num_experts_per_tok": 4,
            "moe_intermediate_size": 384, "swiglu_limit": 7.0, "sliding_window": 128,
            "layer_types": tuple("sliding" if i % 2 == 0 else "full"
                                 for i in range(SMOLLM2.num_layers)),
        },
    }  # fmt: skip
    options["gpt_oss_mxfp4"] = options["gpt_oss"]  # its experts in MXFP4 (MXFP4_ROWS)
    return {name: dataclasses.replace(SMOLLM2, name=name, **o) for name, o in options.items()}


# rows whose expert matrices are MXFP4 blocks, as gpt-oss ships them (the native MXFP4 kernel,
# kernels/cpu/csrc/linear_mxfp4.c; its torch reference with --torch-reference); the row they
# are measured against, with the same shape in fp32 (the expanded reference), is the value
MXFP4_ROWS = {"gpt_oss_mxfp4": "gpt_oss"}


def mxfp4_experts(weights: dict[str, Any]) -> dict[str, Any]:
    """The stacked expert matrices quantized to MXFP4 (kernels/torch_cpu/mxfp4.py), the rest
    as they are."""
    return {name: Mxfp4Experts(tuple(quantize_mxfp4(expert) for expert in tensor))
            if ".mlp.experts." in name and name.endswith(".weight") else tensor
            for name, tensor in weights.items()}  # fmt: skip


def random_weights(config: ModelConfig, seed: int = 0) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    weights = {}
    for name, shape in expected_weight_shapes(config).items():
        if name.endswith("norm.weight"):
            weights[name] = torch.full(shape, 1.0 - config.norm_weight_offset)
        else:
            weights[name] = torch.randn(shape, generator=gen) * 0.02
    return weights


def parameter_counts(config: ModelConfig) -> tuple[int, int]:
    """Total parameters, and those one token reads (the chosen experts only, for MoE)."""
    total = active = 0
    for name, shape in expected_weight_shapes(config).items():
        count = int(torch.Size(shape).numel())
        total += count
        if ".mlp.experts." in name:
            count = count * config.num_experts_per_tok // config.num_experts
        active += count
    return total, active


def _medians(fn: Callable[[], object], repeats: int) -> tuple[float, float]:
    """Median (CPU seconds, wall seconds) of ``fn()`` after one warm-up call."""
    fn()
    cpu, wall = [], []
    for _ in range(repeats):
        cpu_start, wall_start = time.process_time(), time.perf_counter()
        fn()
        cpu.append(time.process_time() - cpu_start)
        wall.append(time.perf_counter() - wall_start)
    return statistics.median(cpu), statistics.median(wall)


def measure(config: ModelConfig, args: Any, native: bool = True) -> dict[str, float]:
    """Prefill and decode tokens/s of one family (the runner built, measured, released);
    ``native``: the native CPU kernels, else the torch reference path."""
    capacity = args.context + args.steps * (args.repeats + 1) + 1
    pages_per_seq = -(-max(capacity, args.prefill) // 16)
    weights = random_weights(config)
    if config.name in MXFP4_ROWS:
        weights = mxfp4_experts(weights)
    settings = EngineConfig(num_pages=pages_per_seq * args.batch, page_size=16, device="cpu",
                            dtype="fp32", native_kernels=native, num_state_slots=64)
    runner = ModelRunner(config, weights, settings)
    gen = torch.Generator().manual_seed(args.seed)
    prompt = torch.randint(FIRST_ORDINARY_TOKEN, config.vocab_size, (args.prefill,),
                           generator=gen).tolist()
    table = list(range(pages_per_seq))

    # a hybrid model's prefill starts from a zeroed state slot (slot 0)
    state = ChunkState(0, ZERO_STATE) if runner.is_hybrid else None
    prefill_cpu, prefill_wall = _medians(
        lambda: runner.execute([SeqChunk(prompt, 0, table, True, state=state)]), args.repeats
    )
    context = prompt[: args.context]
    first = int(runner.execute([SeqChunk(context, 0, table, True, state=state)])[0].argmax())
    decode = _OurDecode(runner, args.batch, args.context, capacity, first)
    decode_cpu, decode_wall = _medians(lambda: decode.run(args.steps), args.repeats)
    total, active = parameter_counts(config)
    decoded = args.batch * args.steps
    return {
        "prefill_tok_s": args.prefill / prefill_cpu,
        "decode_tok_s": decoded / decode_cpu,
        "prefill_tok_wall_s": args.prefill / prefill_wall,
        "decode_tok_wall_s": decoded / decode_wall,
        "params": total,
        "active_params": active,
    }


def main() -> None:
    parser = base_parser(__doc__.splitlines()[0])
    parser.add_argument("--families", nargs="+", default=None, help="default: every family")
    parser.add_argument("--prefill", type=int, default=512)
    parser.add_argument("--context", type=int, default=512, help="decode context length")
    parser.add_argument("--batch", type=int, default=8, help="decode batch")
    parser.add_argument("--steps", type=int, default=8, help="decode steps per sample")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--window", type=int, default=512, help="Gemma 3's sliding window")
    parser.add_argument("--threads", type=int, default=1, help="torch threads")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--torch-reference", action="store_true",
                        help="every family again on the torch reference path")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    configs = family_configs(args.window)
    names = args.families or list(configs)
    if "smollm2" not in names:
        names = ["smollm2", *names]
    results = {name: measure(configs[name], args) for name in names}
    rows = _rows(results, "")
    reference = None
    if args.torch_reference:
        reference = {name: measure(configs[name], args, native=False) for name in names}
        rows += _rows(reference, "torch ")
        rows += [(f"{name:<10} native / torch, prefill | decode tok/CPU-s",
                  f"{results[name]['prefill_tok_s'] / reference[name]['prefill_tok_s']:.2f} | "
                  f"{results[name]['decode_tok_s'] / reference[name]['decode_tok_s']:.2f}")
                 for name in names]  # fmt: skip
    rows += _mxfp4_rows(results)
    print_table(f"families at SmolLM2-135M's shape, CPU fp32, {torch.get_num_threads()} threads "
                f"(prefill {args.prefill}; decode b={args.batch} at {args.context})", rows)
    write_json(args.json, {"args": {k: v for k, v in vars(args).items() if k != "json"},
                           "threads": torch.get_num_threads(), "families": results,
                           "torch_reference": reference})


def _mxfp4_rows(results: dict[str, dict[str, float]]) -> list[tuple[str, Any]]:
    """Each MXFP4 row's tokens/s over its expanded fp32 reference's (native paths, same shape);
    stored in ``results`` as ``{phase}_vs_expanded``."""
    rows: list[tuple[str, Any]] = []
    for name, expanded in MXFP4_ROWS.items():
        if name in results and expanded in results:
            for phase in ("prefill", "decode"):
                ratio = results[name][f"{phase}_tok_s"] / results[expanded][f"{phase}_tok_s"]
                results[name][f"{phase}_vs_expanded"] = ratio
                rows.append((f"{name} / {expanded} (fp32 experts), {phase} tok/CPU-s",
                             f"{ratio:.2f}"))
    return rows


def _rows(results: dict[str, dict[str, float]], path: str) -> list[tuple[str, Any]]:
    """Adds the ratios against the same path's SmolLM2 to ``results``; the table's rows."""
    smol = results["smollm2"]
    rows: list[tuple[str, Any]] = []
    for name, r in results.items():
        for phase in ("prefill", "decode"):
            for params in ("params", "active_params"):
                r[f"{phase}_per_{params[:-1]}_vs_smollm2"] = (
                    r[f"{phase}_tok_s"] * r[params] / (smol[f"{phase}_tok_s"] * smol[params])
                )
        for phase in ("prefill", "decode"):
            rows.append((f"{name:<10} {phase:<7} tok/CPU-s (tok/s) | per param (active) vs smollm2",
                         f"{r[f'{phase}_tok_s']:.1f} ({r[f'{phase}_tok_wall_s']:.1f}) | "
                         f"{r[f'{phase}_per_param_vs_smollm2']:.2f} "
                         f"({r[f'{phase}_per_active_param_vs_smollm2']:.2f})"))
        rows.append((f"{name:<10} params (active)",
                     f"{r['params'] / 1e6:.1f}M ({r['active_params'] / 1e6:.1f}M)"))
    return [(path + label, value) for label, value in rows]


if __name__ == "__main__":
    main()
