"""The whole-step native decode (kernels/cpu/decode_step.py) is bit-identical to running the
layers op by op: logits and every K/V byte written, per precision mode and KV dtype, for one
sequence, several, sequences whose pages share a prefix run (cascade groups), a sequence with
several new rows beside decode rows (a draft verification) and short prefill chunks; and it is
bound only where every layer fits it."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from prefixgate.engine.runner import ModelRunner, SeqChunk
from prefixgate.kernels.attention_plan import MIN_SHARED_SAVING_TOKENS
from prefixgate.kernels.cpu.decode_step import MAX_ROWS
from prefixgate.kernels.cpu.library import bf16_instructions, int8_instructions, library

pytestmark = [pytest.mark.slow,
              pytest.mark.skipif(library() is None, reason="needs the native CPU library")]

PAGE = 16


def _modes() -> list[tuple[str, str | None]]:
    modes = [("fp32", None), ("fp32", "bf16")]
    if bf16_instructions():
        modes.append(("bf16", None))
    if int8_instructions():
        modes.append(("q8", None))
    return modes


def _runner(loaded, dtype: str, kv_dtype: str | None, num_pages: int) -> ModelRunner:
    return ModelRunner.from_loaded(loaded, num_pages=num_pages, page_size=PAGE, device="cpu",
                                   dtype=dtype, kv_dtype=kv_dtype)


def _decode(runner: ModelRunner, prompts: list[list[int]], tables: list[list[int]],
            steps: int, native: bool, ran: list[tuple[int, int, int]] | None = None,
            ) -> tuple[list[torch.Tensor], torch.Tensor]:
    """Prefill each prompt, then ``steps`` greedy steps of all of them together, the first of
    which gives sequence 0 four more rows (a draft verification's shape); the logits of those
    steps and the pool afterwards. ``ran`` gets, per native step, its rows, cascade groups and
    sequences with several rows."""
    model = runner.model
    saved = model.decode_step
    assert saved is not None, "the native step should bind for this model"
    model.decode_step = saved if native else None
    if native and ran is not None:
        run = saved.run

        def counted(hidden, cos_sin, slots, block_tables, plan, kv_caches):
            ran.append((hidden.shape[0], len(plan.shared), len(plan.prefill)))
            return run(hidden, cos_sin, slots, block_tables, plan, kv_caches)
        saved.run = counted
    runner.kv_pool.zero_()
    try:
        for prompt, table in zip(prompts, tables, strict=True):
            runner.execute([SeqChunk(prompt, 0, table, True)])
        tokens = [[p[-1]] for p in prompts]
        tokens[0] += prompts[0][:4]  # verification rows: any tokens do
        positions = [len(p) for p in prompts]
        out = []
        for _ in range(steps):
            logits = runner.execute([SeqChunk(tok, pos, table, True) for tok, pos, table
                                     in zip(tokens, positions, tables, strict=True)])
            out.append(logits.clone())
            positions = [p + len(t) for p, t in zip(positions, tokens, strict=True)]
            tokens = [[t] for t in logits.argmax(-1).tolist()]
        return out, runner.kv_pool.clone()
    finally:
        model.decode_step = saved
        vars(saved).pop("run", None)


@pytest.mark.parametrize(("dtype", "kv_dtype"), _modes())
def test_one_call_per_step_is_bit_identical_to_the_per_op_path(loaded_model, dtype, kv_dtype):
    gen = torch.Generator().manual_seed(7)
    shared = torch.randint(100, 1000, (MIN_SHARED_SAVING_TOKENS // 2 + PAGE,),
                           generator=gen).tolist()
    n_shared = len(shared) // PAGE
    cases = {
        "one sequence": ([torch.randint(100, 1000, (37,), generator=gen).tolist()], False),
        "three apart": ([torch.randint(100, 1000, (n,), generator=gen).tolist()
                         for n in (5, 40, 77)], False),
        # three members over a run of full pages: the plan attends the run once (cascade)
        "shared run": ([shared + torch.randint(100, 1000, (n,), generator=gen).tolist()
                        for n in (3, 9, 20)], True),
    }
    runner = _runner(loaded_model, dtype, kv_dtype, num_pages=200)
    for name, (prompts, share) in cases.items():
        tables, next_page = [], 0
        for prompt in prompts:
            own = -(-(len(prompt) + 8) // PAGE)
            if share and tables:  # the shared run's pages are the first member's
                table = tables[0][:n_shared] + list(range(next_page, next_page + own - n_shared))
                next_page += own - n_shared
            else:
                table = list(range(next_page, next_page + own))
                next_page += own
            tables.append(table)
        ran: list[tuple[int, int, int]] = []
        ours, pool_ours = _decode(runner, prompts, tables, steps=4, native=True, ran=ran)
        ref, pool_ref = _decode(runner, prompts, tables, steps=4, native=False)
        # it ran for every prompt of up to MAX_ROWS rows and every step; the first step has
        # sequence 0's five rows; cascade groups where the pages are shared
        prefills, first, rest = ran[:-4], ran[-4], ran[-3:]
        assert [rows for rows, _, _ in prefills] == [len(p) for p in prompts
                                                     if len(p) <= MAX_ROWS], (name, ran)
        assert first[0] == len(prompts) + 4 and first[2] == 1, (name, first)
        assert len(rest) == 3 and all(r[2] == 0 for r in rest), (name, rest)
        assert all(bool(r[1]) == share for r in rest), (name, rest)
        for step, (a, b) in enumerate(zip(ours, ref, strict=True)):
            assert torch.equal(a, b), (name, step, (a - b).abs().max().item())
        assert torch.equal(pool_ours, pool_ref), name


def test_the_step_takes_shared_runs_as_cascade_groups(loaded_model):
    """The case above named "shared run" really plans a cascade group (else it would test the
    plain groups twice)."""
    from prefixgate.kernels.attention_plan import plan_attention

    shared_pages = (MIN_SHARED_SAVING_TOKENS // 2 + PAGE) // PAGE
    tables = [list(range(shared_pages)) + [100 + i] for i in range(3)]
    lens = [shared_pages * PAGE + 5] * 3
    plan = plan_attention(tables, lens, [0, 1, 2, 3], page_size=PAGE,
                          kv_row_elems=loaded_model.config.kv_size)
    assert plan.shared and not plan.padded


def test_a_residual_scale_keeps_the_per_op_path(loaded_model):
    runner = _runner(loaded_model, "fp32", None, num_pages=8)
    assert runner.model.decode_step is not None
    # a residual scale (Granite) is not in the native step: the model keeps the per-op path
    config = dataclasses.replace(loaded_model.config, residual_scale=0.5)
    scaled = _runner(dataclasses.replace(loaded_model, config=config), "fp32", None, 8)
    assert scaled.model.decode_step is None


def _family(name: str):
    from prefixgate.engine.loader import load_model
    from tests.family_fixtures import family_fixture

    return load_model(family_fixture(name).hf_dir)


def _three_apart(runner: ModelRunner, vocab: int) -> tuple[list[list[int]], list[list[int]]]:
    gen = torch.Generator().manual_seed(3)
    prompts = [torch.randint(5, vocab, (n,), generator=gen).tolist() for n in (5, 21, 40)]
    tables, next_page = [], 0
    for prompt in prompts:
        own = -(-(len(prompt) + 8) // PAGE)
        tables.append(list(range(next_page, next_page + own)))
        next_page += own
    return prompts, tables


def test_fp32_weights_a_bias_and_no_rope_are_bit_identical():
    """Weights the default model does not have: fp32 matrices (linear.c, not blocks), q/k/v
    biases (Qwen2's) and layers without RoPE, on a tiny Llama 3; SmolLM3's mix of layers with
    and without RoPE; Qwen3's per-head q/k norms."""
    loaded = _family("llama3")
    config, layers = loaded.config, loaded.config.num_layers
    gen = torch.Generator().manual_seed(11)
    biases = {f"model.layers.{i}.self_attn.{n}_proj.bias":
              torch.randn(size, generator=gen) * 0.1
              for i in range(layers)
              for n, size in (("q", config.q_size), ("k", config.kv_size), ("v", config.kv_size))}
    variants = {
        "fp32": loaded,
        "bias": dataclasses.replace(loaded, config=dataclasses.replace(config, attention_bias=True),
                                    weights={**loaded.weights, **biases}),
        "no rope": dataclasses.replace(loaded, config=dataclasses.replace(
            config, rope_layers=(False,) * layers)),
    }
    # SmolLM3: every fourth layer without RoPE, the others with it; Qwen3: per-head q/k norms
    variants["smollm3"] = _family("smollm3")
    assert set(variants["smollm3"].config.rope_layers) == {True, False}
    variants["qwen3"] = _family("qwen3")
    assert variants["qwen3"].config.qk_norm and not variants["qwen3"].config.qk_norm_full
    for name, variant in variants.items():
        config = variant.config
        runner = _runner(variant, "fp32", None, num_pages=64)
        qkv = runner.model.layers[0].qkv
        assert qkv.native is not None and qkv.quant is None and not qkv.bf16, name
        prompts, tables = _three_apart(runner, config.vocab_size)
        ran: list[tuple[int, int, int]] = []
        ours, pool_ours = _decode(runner, prompts, tables, steps=3, native=True, ran=ran)
        ref, pool_ref = _decode(runner, prompts, tables, steps=3, native=False)
        assert len(ran) == len(prompts) + 3, (name, ran)
        for step, (a, b) in enumerate(zip(ours, ref, strict=True)):
            assert torch.equal(a, b), (name, step, (a - b).abs().max().item())
        assert torch.equal(pool_ours, pool_ref), name


@pytest.mark.parametrize("bad", ["slot", "page"])
def test_bad_addressing_is_refused_before_anything_is_written(loaded_model, bad):
    """A slot or a page id outside the pool is refused before layer 0 writes its K/V (the
    kernels' own checks come per layer, after that layer's write)."""
    runner = _runner(loaded_model, "fp32", None, num_pages=16)
    step = runner.model.decode_step
    prompts, tables = _three_apart(runner, 1000)
    for prompt, table in zip(prompts, tables, strict=True):
        runner.execute([SeqChunk(prompt, 0, table, True)])
    before = runner.kv_pool.clone()
    run = step.run
    num_pages = runner.kv_pool.shape[2]

    def corrupted(hidden, cos_sin, slots, block_tables, plan, kv_caches):
        if bad == "slot":
            slots = slots.clone()
            slots[-1] = num_pages * PAGE  # one past the pool
        else:
            chunk = plan.padded[0]
            pages = chunk.pages.clone()
            pages[-1, 0] = num_pages
            plan = dataclasses.replace(
                plan, padded=[dataclasses.replace(chunk, pages=pages), *plan.padded[1:]])
        return run(hidden, cos_sin, slots, block_tables, plan, kv_caches)
    step.run = corrupted
    try:
        with pytest.raises(ValueError, match="nothing written"):
            runner.execute([SeqChunk([p[-1]], len(p), t, True)
                            for p, t in zip(prompts, tables, strict=True)])
    finally:
        del step.run
    assert torch.equal(runner.kv_pool, before)


def test_families_outside_the_dense_stack_keep_the_per_op_path(loaded_model):
    """Sliding layers with sandwich norms (Gemma 3), q/k norms over whole projections with
    post-norms (OLMo 2) and a residual scale (Granite) do not bind; ``--native-decode-step off``
    turns it off for any model."""
    for name in ("gemma3", "olmo2", "granite"):
        assert _runner(_family(name), "fp32", None, num_pages=8).model.decode_step is None, name
    off = ModelRunner.from_loaded(loaded_model, num_pages=8, page_size=PAGE, device="cpu",
                                  native_decode_step=False)
    assert off.model.decode_step is None
