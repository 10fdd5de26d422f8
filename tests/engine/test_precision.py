"""The CPU bf16 and q8 modes (engine/precision.py, docs/precision.md) on the real default
model: refused where they cannot run; bf16 matrices, fp32 activations and the bf16 KV by default /
the GGUF blocks on int8 activations, fp32 KV; greedy output identical with a cache hit vs a miss
and alone vs batched; reported by the engine. Their quality bounds against the fp32 path:
tests/benchmarks/test_fidelity.py."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from prefixgate.engine import precision
from prefixgate.engine.async_engine import AsyncEngine
from prefixgate.engine.build import create_llm_engine
from prefixgate.engine.config import EngineConfig
from prefixgate.engine.kv_budget import resolve_dtype
from prefixgate.engine.runner import ModelRunner, SeqChunk
from prefixgate.kernels.cpu.library import bf16_instructions, int8_instructions
from prefixgate.kernels.cpu.ops import q8_native_available
from tests.engine.test_fidelity import CHATS

pytestmark = pytest.mark.slow
needs_bf16 = pytest.mark.skipif(bf16_instructions() is None,
                                reason="this CPU has no AVX512-BF16 / AMX-BF16")
needs_q8 = pytest.mark.skipif(int8_instructions() is None or not q8_native_available(),
                              reason="no AVX512-VNNI here, or the native kernels did not build")
NEW_TOKENS = 12


@pytest.fixture(scope="module")
def bf16_runner(loaded_model) -> ModelRunner:
    if bf16_instructions() is None:
        pytest.skip("this CPU has no AVX512-BF16 / AMX-BF16")
    return ModelRunner.from_loaded(loaded_model, num_pages=256, page_size=16, device="cpu",
                                   dtype="bf16")


def test_refused_where_the_cpu_lacks_bf16_instructions(monkeypatch, loaded_model):
    monkeypatch.setattr(precision, "bf16_instructions", lambda: None)
    with pytest.raises(ValueError, match="AVX512-BF16 or AMX-BF16"):
        precision.check_precision("cpu", "bf16")
    with pytest.raises(ValueError, match="AVX512-BF16 or AMX-BF16"):
        ModelRunner.from_loaded(loaded_model, num_pages=8, device="cpu", dtype="bf16")
    precision.check_precision("cpu", None)  # auto and fp32 need nothing
    precision.check_precision("cpu", "fp32")


@pytest.fixture(scope="module")
def q8_runner(loaded_model) -> ModelRunner:
    if int8_instructions() is None or not q8_native_available():
        pytest.skip("no AVX512-VNNI here, or the native kernels did not build")
    return ModelRunner.from_loaded(loaded_model, num_pages=256, page_size=16, device="cpu",
                                   dtype="q8")


def test_q8_refused_where_it_cannot_run(monkeypatch, loaded_model):
    monkeypatch.setattr(precision, "int8_instructions", lambda: None)
    with pytest.raises(ValueError, match="AVX512-VNNI and AVX512-BW"):
        precision.check_precision("cpu", "q8")
    with pytest.raises(ValueError, match="AVX512-VNNI and AVX512-BW"):
        ModelRunner.from_loaded(loaded_model, num_pages=8, device="cpu", dtype="q8")
    monkeypatch.setattr(precision, "int8_instructions", lambda: "avx512_vnni")
    monkeypatch.setattr(precision, "q8_native_available", lambda: False)
    with pytest.raises(ValueError, match="needs the native CPU kernels"):
        precision.check_precision("cpu", "q8")


@needs_q8
def test_q8_refused_without_blocks_to_run(loaded_model):
    with pytest.raises(ValueError, match="native CPU kernels are off"):
        ModelRunner.from_loaded(loaded_model, num_pages=8, device="cpu", dtype="q8",
                                native_kernels=False)
    with pytest.raises(ValueError, match="--quantized-weights is off"):
        ModelRunner.from_loaded(loaded_model, num_pages=8, device="cpu", dtype="q8",
                                quantized_weights=False)
    # an fp32 model's names (refused before any weight is read, so their values do not matter)
    weights = {name: torch.zeros(1) for name in loaded_model.weights}
    with pytest.raises(ValueError, match="has no Q4_0/Q4_1/Q8_0 matrices"):
        ModelRunner.from_loaded(dataclasses.replace(loaded_model, weights=weights), num_pages=8,
                                device="cpu", dtype="q8")


@needs_q8
def test_q8_mode_layout(q8_runner, loaded_model):
    runner = q8_runner
    assert runner.dtype == torch.float32 and runner.kv_dtype == torch.float32  # KV stays fp32
    assert runner.int8_isa == "avx512_vnni" and runner.bf16_isa is None
    model = runner.model
    layer = model.layers[0]
    for linear in (layer.qkv, layer.o, layer.mlp.gate_up, layer.mlp.down, model.lm_head):
        assert linear.q8 and linear.quant in ("Q4_0", "Q4_1", "Q8_0")
    assert model.int8_layers >= 4 * len(model.layers) + 1
    # the embedding rows come exactly from the (tied) head's q8 layout
    ids = torch.tensor([0, 7, 49151])
    table = loaded_model.weights["model.embed_tokens.weight"]
    assert torch.equal(model.embed_rows.rows(ids), table.dequantize()[ids])


@needs_bf16
def test_bf16_mode_layout(bf16_runner):
    runner = bf16_runner
    assert runner.dtype == torch.bfloat16 and runner.kv_dtype == torch.bfloat16  # KV follows
    assert runner.bf16_isa in ("amx_bf16", "avx512_bf16")
    assert runner.native_cpu_kernels  # the fp32 fused ops and attention serve the activations
    model = runner.model
    assert model.act_dtype == torch.float32 and model.final_norm.dtype == torch.float32
    layer = model.layers[0]
    for linear in (layer.qkv, layer.o, layer.mlp.gate_up, layer.mlp.down, model.lm_head):
        assert linear.bf16 and linear.quant is None  # GGUF blocks expanded to bf16
        assert linear.native is not None and linear.native.dtype == torch.bfloat16


def _greedy_alone(runner: ModelRunner, prompt: list[int], table: list[int],
                  first: torch.Tensor) -> list[int]:
    tokens = [int(first.argmax())]
    for step in range(NEW_TOKENS - 1):
        logits = runner.execute([SeqChunk([tokens[-1]], len(prompt) + step, table, True)])
        tokens.append(int(logits[0].argmax()))
    return tokens


@needs_bf16
def test_greedy_identical_with_a_cache_hit_and_a_miss(bf16_runner, tokenizer):
    _hit_and_miss_agree(bf16_runner, tokenizer)


@needs_q8
def test_q8_greedy_identical_with_a_cache_hit_and_a_miss(q8_runner, tokenizer):
    _hit_and_miss_agree(q8_runner, tokenizer)


def _hit_and_miss_agree(runner: ModelRunner, tokenizer) -> None:
    prompt = tokenizer.apply_chat_template(CHATS[4])
    cached = (len(prompt) // runner.page_size - 1) * runner.page_size
    span = -(-(len(prompt) + NEW_TOKENS) // runner.page_size)
    fresh_table = list(range(span))
    fresh = runner.execute([SeqChunk(prompt, 0, fresh_table, True)])[0]
    prefix_table = list(range(span, span + cached // runner.page_size))
    runner.execute([SeqChunk(prompt[:cached], 0, prefix_table, False)])
    table = prefix_table + list(range(2 * span, 2 * span + span - len(prefix_table)))
    hit = runner.execute([SeqChunk(prompt[cached:], cached, table, True)])[0]
    assert _greedy_alone(runner, prompt, table, hit) == _greedy_alone(
        runner, prompt, fresh_table, fresh)


@needs_bf16
def test_greedy_identical_alone_and_batched(bf16_runner, tokenizer):
    _alone_and_batched_agree(bf16_runner, tokenizer)


@needs_q8
def test_q8_greedy_identical_alone_and_batched(q8_runner, tokenizer):
    _alone_and_batched_agree(q8_runner, tokenizer)


def _alone_and_batched_agree(runner: ModelRunner, tokenizer) -> None:
    from benchmarks.fidelity import greedy

    prompts = [tokenizer.apply_chat_template(chat) for chat in CHATS[:3]]
    batched = greedy(runner, prompts, NEW_TOKENS)
    assert [greedy(runner, [prompt], NEW_TOKENS)[0] for prompt in prompts] == batched


@needs_bf16
def test_engine_reports_its_precision(loaded_model):
    config = EngineConfig(num_pages=16, device="cpu", dtype="bf16")
    core, info = create_llm_engine(config, loaded=loaded_model)
    assert (info["dtype"], info["kv_dtype"]) == ("bfloat16", "bfloat16")
    engine = AsyncEngine(core, model_name="m", dtype=info["dtype"], kv_dtype=info["kv_dtype"])
    stats = engine.engine_stats()
    assert (stats.dtype, stats.kv_dtype) == ("bfloat16", "bfloat16")
    # auto stays the exact fp32 on CPU
    assert resolve_dtype(None, torch.device("cpu")) == resolve_dtype("auto", torch.device("cpu"))
    assert resolve_dtype("auto", torch.device("cpu")) == torch.float32


@needs_q8
def test_engine_reports_the_q8_mode(loaded_model):
    config = EngineConfig(num_pages=16, device="cpu", dtype="q8")
    core, info = create_llm_engine(config, loaded=loaded_model)
    assert (info["dtype"], info["kv_dtype"]) == ("q8", "float32")


@needs_q8
@pytest.mark.parametrize("name", ["phi3", "qwen3_moe"])  # split q|k|v; experts
def test_q8_runs_other_families_in_their_blocks(name):
    from prefixgate.engine.loader import load_gguf
    from tests.family_fixtures import quantized_gguf

    loaded = load_gguf(quantized_gguf(name, "Q8_0"))
    ids = list(range(200, 245))
    exact, q8 = (ModelRunner.from_loaded(loaded, num_pages=8, device="cpu", dtype=dtype)
                 for dtype in ("fp32", "q8"))
    layer = q8.model.layers[0]
    assert layer.qkv.q8 and not exact.model.layers[0].qkv.q8
    if name == "qwen3_moe":  # each expert's gate|up and down too
        assert all(part.q8 for expert in layer.mlp.experts for part in expert)
    want, got = (runner.execute([SeqChunk(ids, 0, [0, 1, 2], True, num_logits=len(ids))])
                 for runner in (exact, q8))
    # these random fixtures measured ~2-3% relative error per position (the MoE's worst
    # position more: a near-tie in its routing flips an expert), so a median bound
    error = (got - want).norm(dim=-1) / want.norm(dim=-1)
    assert 0 < error.median() < 0.06
