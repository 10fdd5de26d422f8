"""The CPU bf16 mode (gateway/engine/precision.py, docs/precision.md) on the real default model:
refused without bf16 instructions; bf16 matrices, fp32 activations and the bf16 KV by default;
greedy output identical with a cache hit vs a miss and alone vs batched; reported by the engine.
Its quality bounds against the fp32 path: tests/benchmarks/test_fidelity.py."""

from __future__ import annotations

import pytest
import torch

from prefixgate.gateway.engine import precision
from prefixgate.gateway.engine.config import EngineConfig
from prefixgate.gateway.engine.engine import AsyncEngine
from prefixgate.gateway.engine.factory import create_llm_engine
from prefixgate.gateway.engine.kv_budget import resolve_dtype
from prefixgate.gateway.engine.runner import ModelRunner, SeqChunk
from prefixgate.kernels.cpu.library import bf16_instructions
from tests.engine.test_fidelity import CHATS

pytestmark = pytest.mark.slow
needs_bf16 = pytest.mark.skipif(bf16_instructions() is None,
                                reason="this CPU has no AVX512-BF16 / AMX-BF16")
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
    runner = bf16_runner
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
    from benchmarks.fidelity import greedy

    prompts = [tokenizer.apply_chat_template(chat) for chat in CHATS[:3]]
    batched = greedy(bf16_runner, prompts, NEW_TOKENS)
    assert [greedy(bf16_runner, [prompt], NEW_TOKENS)[0] for prompt in prompts] == batched


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
