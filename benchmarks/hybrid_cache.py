"""Prefix hits of a hybrid model (Qwen3.5: recurrent state + paged KV) against a pure-attention
model of the same size, and the state-checkpoint cadence choices (issue 36 §2, §5).

Workload (engine level, greedy, the tiny random-weight fixtures of tests/family_fixtures.py):
``AGENTS`` agents share a ``SYSTEM``-token prompt; each runs ``TURNS`` turns of a tool loop: the
model writes ``OUTPUT`` tokens, the tool answers ``TOOL`` tokens, and the next turn's prompt
is the previous prompt + output + tool answer. Every turn submits all agents at once (they
batch). A short-prefix row: 8 requests sharing only a 20-token prefix (below vLLM's 528-token
hybrid block). A late-divergence row (where the cadence matters): one ``BASE``-token prompt,
then ``LATE`` requests, one at a time, each sharing a different random-length prefix of it
(none of them known when the base prompt ran, so only its cadence checkpoints can serve them).

* ideal = per request, the longest prefix it shares with any earlier request's prompt + output,
  rounded down to a whole block (what a pure-attention paged cache can reuse), capped one token
  short of the prompt;
* achieved = the engine's ``usage.cached_tokens``;
* per cadence (checkpoint every N prefill blocks; each chunk's last full block and the block
  where a prompt leaves the cache are always checkpointed): achieved/ideal, checkpoints
  written (each one a state copy), the most state slots in use, the bytes of a slot for the
  tiny fixture and for Qwen3.5-0.8B's shape.

Nothing is timed: every figure is deterministic.

Run::

    python -m benchmarks.hybrid_cache --json out/hybrid_cache.json
"""

from __future__ import annotations

import json
import random
from typing import Any

from benchmarks.common import base_parser, write_json
from prefixgate.engine.api import GenerationRequest, SamplingParams
from prefixgate.engine.build import create_llm_engine
from prefixgate.engine.config import EngineConfig
from prefixgate.engine.kv_budget import kv_page_bytes, state_slot_bytes
from prefixgate.engine.loader import load_model
from prefixgate.engine.model_config import LinearAttentionConfig, ModelConfig
from tests.family_fixtures import family_fixture

AGENTS, TURNS, SYSTEM, OUTPUT, TOOL, PAGE = 8, 4, 300, 12, 23, 16
BASE, LATE = 400, 12
CADENCES = (1, 2, 4, 8)
# Qwen3.5-0.8B's text config (its config.json): 24 layers, 18 linear, 6 full attention
QWEN35_08B = dict(hidden=1024, layers=24, heads=8, kv_heads=2, head_dim=256,
                  linear=LinearAttentionConfig((True, True, True, False) * 6, 4, 16, 16, 128, 128))


def _engine(loaded: Any, every: int, caching: bool = True) -> Any:
    config = EngineConfig(num_pages=1024, page_size=PAGE, device="cpu", max_num_seqs=AGENTS,
                          num_state_slots=AGENTS * 16, state_checkpoint_every=every,
                          enable_prefix_caching=caching)
    return create_llm_engine(config, loaded=loaded)[0]


def _ideal(prompt: list[int], seen: list[list[int]]) -> int:
    best = 0
    for other in seen:
        n = 0
        while n < min(len(prompt), len(other)) and prompt[n] == other[n]:
            n += 1
        best = max(best, n)
    return min(best // PAGE * PAGE, (len(prompt) - 1) // PAGE * PAGE)


def _round(engine: Any, prompts: dict[str, list[int]], seen: list[list[int]],
           tally: dict[str, int]) -> dict[str, list[int]]:
    """Submit every prompt at once; step until done; count achieved/ideal; return outputs."""
    greedy = SamplingParams(max_tokens=OUTPUT, temperature=0.0, ignore_eos=True)
    outputs: dict[str, list[int]] = {key: [] for key in prompts}
    cached: dict[str, int] = {}

    def sink(key: str):
        def on_delta(delta: Any) -> None:
            outputs[key].extend(delta.token_ids)
            if delta.usage is not None:
                cached[key] = delta.usage.cached_tokens
        return on_delta

    submitted: list[list[int]] = []
    for key, prompt in prompts.items():
        # the requests of this round submitted before it count too (in-flight dedup)
        tally["ideal"] += _ideal(prompt, seen + submitted)
        submitted.append(prompt)
        engine.add_request(GenerationRequest(tuple(prompt), greedy, request_id=key), sink(key))
    peak = 0
    while engine.has_work():
        engine.step()
        state = engine.scheduler.cache.state
        if state is not None:
            peak = max(peak, state.num_working + state.num_checkpoints)
    tally["peak_slots"] = max(tally.get("peak_slots", 0), peak)
    tally["achieved"] += sum(cached.values())
    for key, prompt in prompts.items():
        seen.append(prompt + outputs[key])
    return outputs


def swarm(loaded: Any, every: int) -> dict[str, int]:
    engine = _engine(loaded, every)
    system = [(7 * i) % 900 + 50 for i in range(SYSTEM)]
    history = {f"a{a}": system + [1000 + a, 1001 + a, 1002 + a] for a in range(AGENTS)}
    tally = {"ideal": 0, "achieved": 0}
    seen: list[list[int]] = []
    for turn in range(TURNS):
        outputs = _round(engine, {f"{k}-t{turn}": v for k, v in history.items()}, seen, tally)
        for key in history:
            tool = [(3 * turn + 11 * i) % 700 + 60 for i in range(TOOL)]
            history[key] = history[key] + outputs[f"{key}-t{turn}"] + tool
    engine.scheduler.cache.check_integrity()
    state = engine.scheduler.cache.state
    if state is not None:
        tally["checkpoints_written"] = state.num_saved
    return tally


def short_prefix(loaded: Any, every: int) -> dict[str, int]:
    engine = _engine(loaded, every)
    tally = {"ideal": 0, "achieved": 0}
    seen: list[list[int]] = []
    for i in range(8):  # one at a time: each may hit the ones before
        _round(engine, {f"s{i}": list(range(100, 120)) + [300 + i, 400 + i]}, seen, tally)
    return tally


def late_divergence(loaded: Any, every: int) -> dict[str, int]:
    engine = _engine(loaded, every)
    base = [(13 * i) % 800 + 70 for i in range(BASE)]
    tally = {"ideal": 0, "achieved": 0}
    seen: list[list[int]] = []
    _round(engine, {"base": base}, seen, tally)
    rng = random.Random(5)
    for i in range(LATE):
        shared = rng.randrange(20, BASE - 10)
        _round(engine, {f"late{i}": base[:shared] + [900 + i] * 8}, seen, tally)
    tally["checkpoints_held"] = engine.scheduler.cache.state.num_checkpoints if engine.scheduler.cache.state else 0
    return tally


def _ratio(tally: dict[str, int]) -> float:
    return round(tally["achieved"] / tally["ideal"], 4) if tally["ideal"] else 0.0


def main() -> None:
    args = base_parser(__doc__.splitlines()[0]).parse_args()
    hybrid = load_model(family_fixture("qwen3_5").hf_dir)
    attention = load_model(family_fixture("qwen3").hf_dir)
    base = swarm(attention, 1)
    late = late_divergence(attention, 1)
    rows: dict[str, Any] = {"pure_attention_swarm": base | {"ratio": _ratio(base)},
                            "pure_attention_late_divergence": late | {"ratio": _ratio(late)}}
    big = ModelConfig(architecture="qwen3_5_text", name="qwen3.5-0.8b-shape", vocab_size=248320,
                      hidden_size=QWEN35_08B["hidden"], intermediate_size=3584,
                      num_layers=QWEN35_08B["layers"], num_heads=QWEN35_08B["heads"],
                      num_kv_heads=QWEN35_08B["kv_heads"], head_dim=QWEN35_08B["head_dim"],
                      rms_norm_eps=1e-6, rope_theta=1e7, max_position_embeddings=262144,
                      tie_word_embeddings=True, attention_bias=False,
                      linear_attention=QWEN35_08B["linear"])
    import torch

    sizes = {
        "tiny_slot_bytes": state_slot_bytes(hybrid.config),
        "tiny_page_bytes": kv_page_bytes(hybrid.config, PAGE, torch.float32),
        "qwen35_08b_slot_bytes": state_slot_bytes(big),
        "qwen35_08b_page_bytes_bf16": kv_page_bytes(big, PAGE, torch.bfloat16),
    }
    for every in CADENCES:
        tally = swarm(hybrid, every)
        short = short_prefix(hybrid, every)
        late = late_divergence(hybrid, every)
        rows[f"hybrid_every_{every}"] = tally | {
            "late_divergence_ratio": _ratio(late), "late_checkpoints_held": late["checkpoints_held"],
            "ratio": _ratio(tally),
            "vs_pure_attention": round(_ratio(tally) / _ratio(base), 4) if _ratio(base) else 0.0,
            "short_prefix_hit_tokens": short["achieved"], "short_prefix_ratio": _ratio(short),
        }
    result = {"workload": dict(agents=AGENTS, turns=TURNS, system=SYSTEM, output=OUTPUT,
                               tool=TOOL, page=PAGE), "sizes": sizes, "rows": rows}
    print(json.dumps(result, indent=2))
    if args.json:
        write_json(args.json, result)


if __name__ == "__main__":
    main()
