"""Qwen3.5 hybrids (Gated DeltaNet + gated attention, dense and MoE) against transformers on
the same random weights, and the state cache's contract at the runner: a continuation restored
from a checkpoint at any block is identical to a cold run, alone = batched.

The fixtures (tests/family_fixtures.py) have 3 linear layers and 1 full layer, the real
Qwen3.5 tokenizer and template; the runner's pages are 16 tokens.
"""

from __future__ import annotations

import pytest
import torch

from prefixgate.engine.runner import ZERO_STATE, ChunkState, SeqChunk
from tests.engine.test_fidelity import LAYOUT_ATOL, PREFILL_ATOL, Pages

pytestmark = pytest.mark.slow

HYBRIDS = ("qwen3_5", "qwen3_5_moe")
NEW_TOKENS = 8


def _oracle_logits(oracle, ids: list[int]) -> torch.Tensor:
    with torch.inference_mode():
        return oracle(torch.tensor([ids])).logits[0].float()


class Slots:
    """Hands out distinct state slots (the cache's job in the engine)."""

    def __init__(self) -> None:
        self.next = 0

    def take(self) -> int:
        self.next += 1
        return self.next - 1


def _prompt(case) -> list[int]:
    # the chat prompt (36 tokens) three times over: seven 16-token blocks
    return case.prompt * 3


def _chunk(ids, start, table, slot, *, restore=None, saves=(), logits=True) -> SeqChunk:
    return SeqChunk(ids, start, table, logits, state=ChunkState(slot, restore, tuple(saves)))


@pytest.mark.parametrize("name", HYBRIDS)
def test_hybrid_matches_transformers_chunked_and_greedy(family_case, name):
    case = family_case(name)
    prompt, runner = _prompt(case), case.runner
    assert runner.is_hybrid and len(prompt) > 3 * runner.page_size
    reference = _oracle_logits(case.oracle, prompt)
    table, slot = Pages(runner, seed=2).take(len(prompt) + NEW_TOKENS), Slots().take()
    bounds = [0, 5, 16, 17, 31, len(prompt)]  # page-aligned and not, a 1-token chunk
    for start, end in zip(bounds, bounds[1:], strict=False):
        restore = ZERO_STATE if start == 0 else None
        ours = runner.execute([_chunk(prompt[start:end], start, table, slot, restore=restore)])[0]
        diff = (ours - reference[end - 1]).abs().max().item()
        assert diff < PREFILL_ATOL, f"{name}: chunk {start}:{end} logits differ by {diff}"
    tokens = [int(ours.argmax())]
    for step in range(NEW_TOKENS - 1):
        logits = runner.execute([_chunk([tokens[-1]], len(prompt) + step, table, slot)])[0]
        tokens.append(int(logits.argmax()))
    teacher = _oracle_logits(case.oracle, prompt + tokens[:-1])[len(prompt) - 1 :]
    assert teacher.argmax(-1).tolist() == tokens


@pytest.mark.parametrize("name", HYBRIDS)
def test_restored_checkpoint_equals_cold_at_every_block(family_case, name):
    """Cold prefill checkpoints every block boundary; a second sequence sharing the pages up
    to block k and restoring checkpoint k computes the rest: its logits equal the cold run's
    bit for bit, at every k (and a failed forward left no state advanced)."""
    case = family_case(name)
    prompt, runner = _prompt(case), case.runner
    ps = runner.page_size
    pages, slots = Pages(runner, seed=7), Slots()
    cold_table, cold_slot = pages.take(len(prompt)), slots.take()
    blocks = (len(prompt) - 1) // ps
    checkpoints = [slots.take() for _ in range(blocks)]
    saves = [((b + 1) * ps - 1, checkpoints[b]) for b in range(blocks)]
    cold = runner.execute([_chunk(prompt, 0, cold_table, cold_slot, restore=ZERO_STATE, saves=saves)])[0]
    for k in range(1, blocks + 1):
        cached = k * ps
        table = cold_table[:k] + pages.take(len(prompt) - cached)
        warm = runner.execute([_chunk(prompt[cached:], cached, table, slots.take(),
                                      restore=checkpoints[k - 1])])[0]
        if name == "qwen3_5":
            assert torch.equal(warm, cold), f"{name}: hit at block {k} differs from cold"
        else:
            # the routed experts' GEMMs run over the tokens each expert got this step, so a
            # shorter suffix rounds differently there (as for Qwen3-MoE); the state is exact
            assert (warm - cold).abs().max().item() < LAYOUT_ATOL
            assert int(warm.argmax()) == int(cold.argmax())


@pytest.mark.parametrize("name", HYBRIDS)
def test_alone_equals_batched(family_case, name):
    case = family_case(name)
    prompt, runner = _prompt(case), case.runner
    pages, slots = Pages(runner, seed=11), Slots()
    other = prompt[5:40]
    alone_table, alone_slot = pages.take(len(prompt)), slots.take()
    alone = runner.execute([_chunk(prompt, 0, alone_table, alone_slot, restore=ZERO_STATE)])[0]
    table, slot, other_table, other_slot = pages.take(len(prompt)), slots.take(), pages.take(len(other)), slots.take()
    batched = runner.execute([
        _chunk(other, 0, other_table, other_slot, restore=ZERO_STATE),
        _chunk(prompt, 0, table, slot, restore=ZERO_STATE),
    ])
    assert (batched[1] - alone).abs().max().item() < 1e-4
    assert int(batched[1].argmax()) == int(alone.argmax())
    # decode rows of both, batched, continue from their own states
    a = runner.execute([_chunk([7], len(prompt), alone_table, alone_slot)])[0]
    both = runner.execute([_chunk([9], len(other), other_table, other_slot),
                           _chunk([7], len(prompt), table, slot)])
    assert (both[1] - a).abs().max().item() < 1e-4


def test_failed_forward_advances_no_state(family_case):
    case = family_case("qwen3_5")
    prompt, runner = _prompt(case), case.runner
    pages, slots = Pages(runner, seed=13), Slots()
    table, slot = pages.take(len(prompt) + 1), slots.take()
    first = runner.execute([_chunk(prompt, 0, table, slot, restore=ZERO_STATE)])[0]
    with pytest.raises(ValueError):  # a bad chunk beside it: nothing runs
        runner.execute([_chunk([1], len(prompt), table, slot),
                        _chunk([1], 0, table, slot + 1, saves=[(5, 3)])])
    again = runner.execute([_chunk([int(first.argmax())], len(prompt), table, slot)])[0]
    fresh_slot = slots.take()
    runner.execute([_chunk(prompt, 0, table, fresh_slot, restore=ZERO_STATE)])
    expect = runner.execute([_chunk([int(first.argmax())], len(prompt), table, fresh_slot)])[0]
    assert torch.equal(again, expect)


def test_multimodal_checkpoint_loads_its_language_model(tmp_path):
    """Qwen3.5's own checkpoints are Qwen3_5ForConditionalGeneration: the text config nested
    in ``text_config``, the weights under ``model.language_model.``, a vision tower and an MTP
    head beside them. The language model loads as the text-only layout does."""
    import json
    import shutil

    from safetensors.torch import load_file, save_file

    from prefixgate.engine.loader import load_model
    from tests.family_fixtures import family_fixture

    text_dir = family_fixture("qwen3_5").hf_dir
    for item in text_dir.iterdir():
        if item.name not in ("config.json", "model.safetensors"):
            shutil.copy(item, tmp_path / item.name)
    text_config = json.loads((text_dir / "config.json").read_text())
    outer = {"model_type": "qwen3_5", "architectures": ["Qwen3_5ForConditionalGeneration"],
             "text_config": text_config, "vision_config": {"depth": 1}}
    (tmp_path / "config.json").write_text(json.dumps(outer))
    tensors = {("model.language_model." + k.removeprefix("model.")) if k.startswith("model.")
               else k: v for k, v in load_file(text_dir / "model.safetensors").items()}
    tensors["model.visual.blocks.0.attn.qkv.weight"] = torch.zeros(3, 3)
    tensors["mtp.fc.weight"] = torch.zeros(2, 2)
    save_file(tensors, tmp_path / "model.safetensors")
    nested, flat = load_model(tmp_path), load_model(text_dir)
    assert nested.config.linear_attention == flat.config.linear_attention
    assert sorted(nested.weights) == sorted(flat.weights)
    assert all(torch.equal(nested.weights[k], flat.weights[k]) for k in flat.weights)
