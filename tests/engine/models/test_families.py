"""Every registered family against transformers on the same random weights (fp32, CPU).

Per family (tests/family_fixtures.py): a tiny model with the family's real tokenizer and chat
template, saved as safetensors and written as a llama.cpp-style GGUF. Bounds as
tests/engine/test_fidelity.py: prefill logits within PREFILL_ATOL of transformers', logits of
the same tokens through other page layouts within LAYOUT_ATOL, greedy tokens identical.
Gemma 3's fixture has an 8-token sliding window and 16-token pages, so chunked prefill, prefix
hits and decode all read its local layers across page and window boundaries.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from prefixgate.engine.loader import load_model
from prefixgate.engine.models import family_for
from prefixgate.engine.runner import SeqChunk
from tests.engine.models.conftest import make_runner
from tests.engine.models.greedy import greedy_after
from tests.engine.test_fidelity import LAYOUT_ATOL, PREFILL_ATOL, Pages
from tests.family_fixtures import ATTENTION_FAMILIES as FAMILIES

pytestmark = pytest.mark.slow

NEW_TOKENS = 12


def _oracle_logits(oracle, ids: list[int]) -> torch.Tensor:
    with torch.inference_mode():
        return oracle(torch.tensor([ids])).logits[0].float()  # [T, V]



@pytest.mark.parametrize("name", FAMILIES)
def test_chunked_prefill_matches_transformers(family_case, name):
    # each chunk reads the earlier chunks' K/V from the pages: cached = uncached, per chunk end
    case = family_case(name)
    prompt, runner = case.prompt, case.runner
    assert len(prompt) > 2 * runner.page_size
    reference = _oracle_logits(case.oracle, prompt)
    table = Pages(runner, seed=2).take(len(prompt))
    bounds = [0, 5, 16, 17, 31, len(prompt)]  # page-aligned and not, a 1-token chunk
    for start, end in zip(bounds, bounds[1:], strict=False):
        ours = runner.execute([SeqChunk(prompt[start:end], start, table, True)])[0]
        diff = (ours - reference[end - 1]).abs().max().item()
        assert diff < PREFILL_ATOL, f"{name}: chunk {start}:{end} logits differ by {diff}"
        assert int(ours.argmax()) == int(reference[end - 1].argmax())


@pytest.mark.parametrize("name", FAMILIES)
def test_greedy_identical_to_transformers_and_prefix_hit(family_case, name):
    case = family_case(name)
    prompt, runner = case.prompt, case.runner
    pages = Pages(runner, seed=5)
    fresh_table = pages.take(len(prompt) + NEW_TOKENS)
    fresh = runner.execute([SeqChunk(prompt, 0, fresh_table, True)])[0]
    ours = greedy_after(runner, prompt, fresh_table, fresh, NEW_TOKENS)
    # transformers' greedy choice at every step, teacher-forced with our tokens
    reference = _oracle_logits(case.oracle, prompt + ours[:-1])[len(prompt) - 1 :]
    assert reference.argmax(-1).tolist() == ours
    # a block-aligned prefix hit: another sequence computed the prefix into its pages
    cached = (len(prompt) // runner.page_size) * runner.page_size
    if cached == len(prompt):
        cached -= runner.page_size  # the last prompt token is always computed
    prefix_table = pages.take(cached)
    runner.execute([SeqChunk(prompt[:cached], 0, prefix_table, False)])
    table = prefix_table + pages.take(len(prompt) + NEW_TOKENS - cached)
    hit = runner.execute([SeqChunk(prompt[cached:], cached, table, True)])[0]
    assert (hit - fresh).abs().max().item() < LAYOUT_ATOL
    assert greedy_after(runner, prompt, table, hit, NEW_TOKENS) == ours


@pytest.mark.parametrize("name", ["smollm3", "granite", "olmo2", "olmo3"])
def test_alone_equals_batched(family_case, name):
    # the prompt prefilled and decoded alone, then between two others of other lengths
    case = family_case(name)
    runner, prompt = case.runner, case.prompt
    pages = Pages(runner, seed=11)
    alone_table = pages.take(len(prompt) + NEW_TOKENS)
    alone_first = runner.execute([SeqChunk(prompt, 0, alone_table, True)])
    (alone,) = _decode_together(runner, [prompt], [alone_table], alone_first)
    prompts = [prompt[: len(prompt) // 2], prompt, prompt[3:]]
    tables = [pages.take(len(p) + NEW_TOKENS) for p in prompts]
    first = runner.execute([SeqChunk(p, 0, t, True) for p, t in zip(prompts, tables, strict=True)])
    assert (first[1] - alone_first[0]).abs().max().item() < LAYOUT_ATOL
    assert _decode_together(runner, prompts, tables, first)[1] == alone


def _decode_together(runner, prompts, tables, first) -> list[list[int]]:
    """Greedy steps of every sequence at once, one decode row each per step."""
    outputs = [[int(row.argmax())] for row in first]
    for step in range(NEW_TOKENS - 1):
        rows = [SeqChunk([out[-1]], len(p) + step, t, True)
                for p, t, out in zip(prompts, tables, outputs, strict=True)]  # fmt: skip
        for out, row in zip(outputs, runner.execute(rows), strict=True):
            out.append(int(row.argmax()))
    return outputs


@pytest.mark.parametrize("name", FAMILIES)
def test_gguf_loads_to_the_same_model(family_case, name):
    case = family_case(name)
    gguf = load_model(case.fixture.gguf_path)
    # HF and GGUF spell some architectures differently (gemma3_text / gemma3): same family
    assert family_for(gguf.config.architecture) is family_for(case.loaded.config.architecture)
    ignored = {"architecture", "name", "rms_norm_eps", "max_position_embeddings", "rope_scaling",
               "rope_freq_factors", "query_pre_attn_scalar"}  # fmt: skip
    hf_fields = {k: v for k, v in dataclasses.asdict(case.loaded.config).items() if k not in ignored}
    gguf_fields = {k: v for k, v in dataclasses.asdict(gguf.config).items() if k not in ignored}
    assert gguf_fields == hf_fields
    # the real tokenizer and template travel in the GGUF: the same prompt text, and for the
    # BPE vocabularies the same ids. NOTE: for the sentencepiece ones (phi3, gemma3's
    # llama-spm) transformers' GGUF->tokenizer.json conversion inserts a "▁" after special
    # tokens where llama.cpp does not, so the HF directory's ids differ there
    chat = [{"role": "user", "content": "Hi there"}]
    assert gguf.tokenizer.render_chat(chat) == case.loaded.tokenizer.render_chat(chat)
    if FAMILIES[name].vocab not in ("phi-3", "llama-spm"):
        assert gguf.tokenizer.apply_chat_template(chat) == (
            case.loaded.tokenizer.apply_chat_template(chat)
        )
    runner = make_runner(gguf)
    prompt = case.prompt
    ours = runner.execute([SeqChunk(prompt, 0, Pages(runner).take(len(prompt)), True)])[0]
    reference = _oracle_logits(case.oracle, prompt)[-1]
    assert (ours - reference).abs().max().item() < PREFILL_ATOL
