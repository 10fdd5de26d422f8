"""gpt-oss against transformers on the same tiny random weights (fp32, CPU).

The fixture: transformers' GptOssForCausalLM from a config (2 layers: one sliding with an
8-token window, one full; 4 experts, top-2; YaRN; attention sinks set to visible values),
saved as safetensors with the real o200k_harmony tokenizer and gpt-oss's template
(tests/harmony_fixture.py). Bounds as tests/engine/models/test_families.py. The runner's
native CPU kernels take the sinks and the window in the decode and prefill kernels; the torch
path (native off) is checked against the same reference.
"""

from __future__ import annotations

import pytest
import torch

from prefixgate.engine.loader import load_model
from prefixgate.engine.runner import ModelRunner, SeqChunk
from tests.engine.models.greedy import greedy_after
from tests.engine.test_fidelity import LAYOUT_ATOL, PREFILL_ATOL, Pages
from tests.harmony_fixture import gpt_oss_tiny_dir

NEW_TOKENS = 10


@pytest.fixture(scope="module")
def case():
    folder = gpt_oss_tiny_dir()
    from transformers import AutoModelForCausalLM

    oracle = AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32).eval()
    loaded = load_model(folder)
    prompt = loaded.tokenizer.apply_chat_template(
        [{"role": "user", "content": "Write a haiku about paged caches and sliding windows."}])
    return loaded, oracle, prompt


def _runner(loaded, native: bool = True) -> ModelRunner:
    runner = ModelRunner.from_loaded(loaded, num_pages=64, page_size=16, device="cpu",
                                     dtype="fp32")
    assert runner.native_cpu_kernels or not native
    return runner


def _oracle(oracle, ids: list[int]) -> torch.Tensor:
    with torch.inference_mode():
        return oracle(torch.tensor([ids])).logits[0].float()



def test_the_config_reads_sinks_window_yarn_and_the_experts(case):
    loaded, _, prompt = case
    config = loaded.config
    assert config.layer_types == ("sliding", "full") and config.sliding_window == 8
    assert config.attention_sinks and config.attention_bias and config.attention_out_bias
    assert config.rope_scaling.kind == "yarn" and not config.rope_scaling.truncate
    assert (config.num_experts, config.num_experts_per_tok, config.swiglu_limit) == (4, 2, 7.0)
    assert len(prompt) > 3 * 16  # the prompt runs over pages and past the window


def test_chunked_prefill_matches_transformers(case):
    loaded, oracle, prompt = case
    runner = _runner(loaded)
    reference = _oracle(oracle, prompt)
    table = Pages(runner, seed=2).take(len(prompt))
    bounds = [0, 5, 16, 17, 31, len(prompt)]  # page-aligned and not, a 1-token chunk
    for start, end in zip(bounds, bounds[1:], strict=False):
        ours = runner.execute([SeqChunk(prompt[start:end], start, table, True)])[0]
        diff = (ours - reference[end - 1]).abs().max().item()
        assert diff < PREFILL_ATOL, f"chunk {start}:{end} logits differ by {diff}"


def test_greedy_identical_and_a_prefix_hit_equals_a_fresh_prefill(case):
    loaded, oracle, prompt = case
    runner = _runner(loaded)
    pages = Pages(runner, seed=5)
    fresh_table = pages.take(len(prompt) + NEW_TOKENS)
    fresh = runner.execute([SeqChunk(prompt, 0, fresh_table, True)])[0]
    ours = greedy_after(runner, prompt, fresh_table, fresh, NEW_TOKENS)
    reference = _oracle(oracle, prompt + ours[:-1])[len(prompt) - 1:]
    assert reference.argmax(-1).tolist() == ours
    cached = (len(prompt) - 1) // 16 * 16
    prefix_table = pages.take(cached)
    runner.execute([SeqChunk(prompt[:cached], 0, prefix_table, False)])
    table = prefix_table + pages.take(len(prompt) + NEW_TOKENS - cached)
    hit = runner.execute([SeqChunk(prompt[cached:], cached, table, True)])[0]
    assert (hit - fresh).abs().max().item() < LAYOUT_ATOL
    assert greedy_after(runner, prompt, table, hit, NEW_TOKENS) == ours


def test_alone_equals_batched_and_the_torch_path_agrees(case):
    loaded, _, prompt = case
    runner = _runner(loaded)
    pages = Pages(runner, seed=11)
    alone_table = pages.take(len(prompt) + NEW_TOKENS)
    alone = greedy_after(runner, prompt, alone_table,
                         runner.execute([SeqChunk(prompt, 0, alone_table, True)])[0], NEW_TOKENS)
    prompts = [prompt[: len(prompt) // 2], prompt, prompt[3:]]
    tables = [pages.take(len(p) + NEW_TOKENS) for p in prompts]
    first = runner.execute([SeqChunk(p, 0, t, True) for p, t in zip(prompts, tables, strict=True)])
    outputs = [[int(row.argmax())] for row in first]
    for step in range(NEW_TOKENS - 1):
        rows = [SeqChunk([out[-1]], len(p) + step, t, True)
                for p, t, out in zip(prompts, tables, outputs, strict=True)]  # fmt: skip
        for out, row in zip(outputs, runner.execute(rows), strict=True):
            out.append(int(row.argmax()))
    assert outputs[1] == alone
    torch_runner = ModelRunner.from_loaded(loaded, num_pages=64, page_size=16, device="cpu",
                                           dtype="fp32", native_kernels=False)
    table = Pages(torch_runner).take(len(prompt) + NEW_TOKENS)
    first = torch_runner.execute([SeqChunk(prompt, 0, table, True)])[0]
    assert greedy_after(torch_runner, prompt, table, first, NEW_TOKENS) == alone
