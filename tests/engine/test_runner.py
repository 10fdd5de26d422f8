"""ModelRunner bookkeeping: batch building, validation (nothing runs on bad input), sizing."""

from __future__ import annotations

import pytest
import torch

import prefixgate.kernels.cpu.host_memory as hm
from prefixgate.engine.kv_budget import GIB, kv_page_bytes
from prefixgate.engine.runner import ModelRunner, SeqChunk

pytestmark = pytest.mark.slow


def test_runner_exposes_what_the_engine_needs(model_runner, tokenizer):
    assert model_runner.num_pages == 512
    assert model_runner.page_size == 16
    assert model_runner.max_model_len == 8192
    assert model_runner.vocab_size == 49152
    assert model_runner.eos_token_ids == tokenizer.eos_token_ids
    assert model_runner.kernel_backend == "torch"
    assert model_runner.kv_pool.shape == (30, 2, 512, 16, 3, 64)
    assert model_runner.kv_pool.dtype == torch.float32


def test_batch_layout(model_runner):
    chunks = [
        SeqChunk([5, 6, 7], 14, [9, 4], True),  # crosses from page 9 into page 4
        SeqChunk([8], 0, [11], False),
        SeqChunk([1, 2], 3, [2], True),
    ]
    batch = model_runner._build_batch(chunks)
    assert batch.input_ids.tolist() == [5, 6, 7, 8, 1, 2]
    assert batch.positions.tolist() == [14, 15, 16, 0, 3, 4]
    assert batch.slot_mapping.tolist() == [
        9 * 16 + 14,
        9 * 16 + 15,
        4 * 16,
        11 * 16,
        2 * 16 + 3,
        2 * 16 + 4,
    ]
    assert batch.seq_lens.tolist() == [17, 1, 5]
    assert batch.query_start_loc.tolist() == [0, 3, 4, 6]
    assert batch.block_tables.tolist() == [[9, 4], [11, 0], [2, 0]]
    assert batch.logits_indices.tolist() == [2, 5]
    assert batch.block_tables.dtype == torch.int32 and batch.slot_mapping.dtype == torch.int64


@pytest.mark.parametrize(
    ("chunks", "message"),
    [
        ([], "at least one chunk"),
        ([SeqChunk([], 0, [1], True)], "no tokens"),
        ([SeqChunk([1], -1, [1], True)], "start_pos must be >= 0"),
        ([SeqChunk([1] * 17, 0, [1], True)], "block table has 1 pages, positions up to 17 need 2"),
        ([SeqChunk([1], 0, [512], True)], r"page ids must be in \[0, 512\)"),
        ([SeqChunk([1], 8192, [0] * 513, True)], "past max_model_len 8192"),
    ],
)
def test_bad_chunks_are_rejected_before_anything_runs(model_runner, chunks, message):
    pool = model_runner.kv_pool
    pool[:, :, 300].fill_(1.0)
    pool[:, :, 301].fill_(2.0)
    with pytest.raises(ValueError, match=message):
        model_runner.execute(chunks, copy_pairs=[(300, 301)])
    assert torch.all(pool[:, :, 301] == 2.0)  # the copy did not happen either


@pytest.mark.parametrize(
    ("pairs", "message"),
    [
        ([(0, 512)], "outside the pool"),
        ([(1, 2), (3, 2)], "distinct destinations"),
        ([(1, 2), (2, 3)], "disjoint from the sources"),
    ],
)
def test_bad_copy_pairs_are_rejected(model_runner, pairs, message):
    with pytest.raises(ValueError, match=message):
        model_runner.execute([SeqChunk([1], 0, [5], True)], copy_pairs=pairs)


def test_copy_pairs_run_before_the_forward(model_runner):
    pool = model_runner.kv_pool
    model_runner.execute([SeqChunk(list(range(100, 116)), 0, [310], False)])
    pool[:, :, 311].zero_()
    # the chunk writes position 0 of page 311 right after the copy: the copy must come first
    model_runner.execute([SeqChunk([7], 0, [311], False)], copy_pairs=[(310, 311)])
    assert torch.equal(pool[:, :, 311, 1:], pool[:, :, 310, 1:])
    assert not torch.equal(pool[:, :, 311, 0], pool[:, :, 310, 0])


def test_runner_from_memory_budget_and_max_model_len(loaded_model):
    runner = ModelRunner.from_loaded(loaded_model, kv_memory_gb=0.01, max_model_len=256)
    assert runner.num_pages == int(0.01 * GIB) // kv_page_bytes(
        loaded_model.config, 16, torch.float32
    )
    assert runner.max_model_len == 256
    with pytest.raises(ValueError, match="past max_model_len 256"):
        runner.execute([SeqChunk([1] * 257, 0, list(range(runner.num_pages)), True)])
    logits = runner.execute([SeqChunk([1, 2, 3], 0, [0], True)])
    assert logits.shape == (1, 49152) and logits.dtype == torch.float32


def test_native_kernels_switch_reaches_the_attention_plan_and_the_model(model_runner, loaded_model):
    # the shared runner uses the native CPU kernels here (a C compiler is present)
    assert model_runner.native_cpu_kernels and model_runner.model.native_ops
    assert model_runner.huge_pages == hm.huge_pages_status()  # reported for the CPU runner
    plan = model_runner._build_batch([SeqChunk([1], 20, [0, 1], True)]).attention_plan
    assert plan is not None and plan.use_native
    off = ModelRunner.from_loaded(loaded_model, num_pages=4, native_kernels=False)
    assert not off.native_cpu_kernels and not off.model.native_ops
    assert not off._build_batch([SeqChunk([1], 20, [0, 1], True)]).attention_plan.use_native
    # both compute the same prefill and decode rows (native: fused layer ops + decode kernel)
    prompt = list(range(100, 121))
    on = ModelRunner.from_loaded(loaded_model, kv_pool=off.kv_pool)
    assert on.native_cpu_kernels and on.model.native_ops
    first_on = on.execute([SeqChunk(prompt, 0, [0, 1], True)])
    first = off.execute([SeqChunk(prompt, 0, [0, 1], True)])
    assert (first - first_on).abs().max().item() < 1e-4
    nxt = int(first[0].argmax())
    # the same decode step twice over the same pages (rewriting the same K/V into its slot)
    a = off.execute([SeqChunk([nxt], len(prompt), [0, 1], True)])
    b = on.execute([SeqChunk([nxt], len(prompt), [0, 1], True)])
    assert (a - b).abs().max().item() < 1e-4


def test_bf16_kv_pool_holds_twice_the_pages_and_both_paths_agree(loaded_model):
    """``kv_dtype="bf16"`` under the fp32 model: a bf16 pool (twice the pages in the same
    budget); the native kernels (bf16 K/V write, prefill and decode reading bf16 pages) and the
    torch path agree over it, and with the fp32 pool, within what bf16 K/V allows.

    NOTE: not within fp32 summation order as over an fp32 pool (~1e-4): the two paths' K/V
    differ by ~1e-6 before they are stored, enough to round some elements to the neighbouring
    bf16 (2^-8 apart), and 30 layers carry that on (measured max |logit diff| 0.018-0.025 on
    logits up to ~20; bf16 vs fp32 pool 0.04-0.06). The kernels themselves are compared on
    identical bf16 pages, tightly, in tests/kernels/cpu."""
    config = loaded_model.config
    off = ModelRunner.from_loaded(loaded_model, kv_memory_gb=0.01, kv_dtype="bf16",
                                  native_kernels=False)
    assert off.dtype == torch.float32 and off.kv_dtype == torch.bfloat16
    assert off.kv_pool.dtype == torch.bfloat16
    half_page = kv_page_bytes(config, 16, torch.bfloat16)
    assert half_page * 2 == kv_page_bytes(config, 16, torch.float32)
    assert off.num_pages == int(0.01 * GIB) // half_page
    on = ModelRunner.from_loaded(loaded_model, kv_pool=off.kv_pool)  # its dtype: bf16
    assert on.kv_dtype == torch.bfloat16 and on.native_cpu_kernels and on.model.native_ops
    fp32 = ModelRunner.from_loaded(loaded_model, num_pages=4)
    prompt = list(range(100, 140))  # 40 tokens: prefill across 3 pages
    first_on = on.execute([SeqChunk(prompt, 0, [0, 1, 2], True)])
    first_off = off.execute([SeqChunk(prompt, 0, [0, 1, 2], True)])
    assert (first_on - first_off).abs().max().item() < 0.1
    first_fp32 = fp32.execute([SeqChunk(prompt, 0, [0, 1, 2], True)])
    assert (first_on - first_fp32).abs().max().item() < 0.2
    assert int(first_fp32[0].argmax()) == int(first_on[0].argmax()) == int(first_off[0].argmax())
    nxt = int(first_on[0].argmax())
    a = off.execute([SeqChunk([nxt], len(prompt), [0, 1, 2], True)])
    b = on.execute([SeqChunk([nxt], len(prompt), [0, 1, 2], True)])
    assert (a - b).abs().max().item() < 0.1 and int(a.argmax()) == int(b.argmax())


def test_kv_dtype_is_validated(loaded_model):
    with pytest.raises(ValueError, match="kv_dtype must be one of .* got 'int4'"):
        ModelRunner.from_loaded(loaded_model, num_pages=4, kv_dtype="int4")
    pool = torch.zeros(30, 2, 4, 16, 3, 64)  # fp32
    with pytest.raises(ValueError, match=r"torch\.float32 on cpu; expected .* torch\.bfloat16"):
        ModelRunner.from_loaded(loaded_model, kv_pool=pool, kv_dtype="bf16")
