"""engine/grammar/drafts.py on real xgrammar matchers and the default tokenizer: what a
constrained row drafts (forced tokens, else the n-gram proposal up to the first rejected
token, never a stop token), the per-position masks that verify it, and a matcher that is
always left where it was."""

from __future__ import annotations

import pytest
import torch

from prefixgate.engine.grammar import GrammarCompiler, new_matcher
from prefixgate.engine.grammar.drafts import GrammarDrafts, draft_bitmask, walk
from prefixgate.gateway.server.tools import FunctionTool, ToolChoice, tool_grammar
from tests.engine.test_constrained import JSON

WEATHER = FunctionTool("get_weather", None, {
    "type": "object", "properties": {"city": {"type": "string", "maxLength": 10}},
    "required": ["city"], "additionalProperties": False})


@pytest.fixture(scope="module")
def compiler(tokenizer):
    return GrammarCompiler(tokenizer, tokenizer.vocab_size, tokenizer.eos_token_ids)


def mask(matcher, words: int) -> torch.Tensor:
    out = torch.empty((1, words), dtype=torch.int32)
    matcher.fill_next_token_bitmask(out, 0)
    return out[0]


def text(tokenizer, ids) -> str:
    return tokenizer.decode(list(ids), skip_special_tokens=False)


def test_a_tool_call_drafts_its_forced_structure_and_leaves_the_matcher(compiler, tokenizer):
    spec = tool_grammar([WEATHER], ToolChoice("required", parallel=False), None,
                        lambda i: f"tools[{i}].function.parameters")
    matcher = new_matcher(compiler.compile(spec))
    words = (compiler.vocab_size + 31) // 32
    before = mask(matcher, words)
    drafts = GrammarDrafts(matcher).constrain([], 32)
    # one tool, a call required: everything up to the city's value is forced (xgrammar keeps
    # back a last token that a longer one could extend: ' "' here)
    assert text(tokenizer, drafts).startswith('<tool_call>\n{"name": "get_weather", "arguments": {"city"')
    assert torch.equal(mask(matcher, words), before)  # rolled back
    assert GrammarDrafts(matcher).constrain([], 3) == drafts[:3]  # the limit holds
    for token in drafts:  # every draft is one the sequence may emit, in order
        assert matcher.accept_token(token)


def test_the_ngram_proposal_is_cut_at_the_first_token_the_grammar_rejects(compiler, tokenizer):
    matcher = new_matcher(compiler.compile(JSON))
    assert matcher.accept_string('{"city": "')  # a free string: nothing is forced here
    assert matcher.find_jump_forward_tokens() == []
    good = tokenizer.encode("Oslo")
    assert walk(matcher, good) == good
    assert GrammarDrafts(matcher).constrain(good, 8) == good
    after_value = new_matcher(compiler.compile(JSON))
    assert after_value.accept_string('{"city": "Oslo", "days": ')
    digits_then_letter = [*tokenizer.encode("3"), *tokenizer.encode("x")]
    assert walk(after_value, digits_then_letter) == tokenizer.encode("3")  # 'x' is no integer
    assert GrammarDrafts(after_value).constrain(digits_then_letter, 8) == tokenizer.encode("3")


def test_a_stop_token_is_never_drafted(compiler, tokenizer):
    matcher = new_matcher(compiler.compile(JSON))
    assert matcher.accept_string('{"city": "Oslo", "days": 3, "unit": "celsius"}')
    eos = tokenizer.eos_token_ids[0]
    assert matcher.accept_token(eos) and matcher.is_terminated()
    matcher.rollback(1)
    assert GrammarDrafts(matcher).constrain([eos, eos], 4) == []
    assert not matcher.is_terminated()


def test_draft_masks_are_the_grammar_after_each_draft(compiler, tokenizer):
    matcher = new_matcher(compiler.compile(JSON))
    words = (compiler.vocab_size + 31) // 32
    drafts = GrammarDrafts(matcher).constrain([], 4)
    assert len(drafts) >= 2
    got = draft_bitmask(matcher, drafts, words)
    assert got.shape == (len(drafts) + 1, words) and got.dtype == torch.int32
    reference = new_matcher(compiler.compile(JSON))
    for i in range(len(drafts) + 1):
        assert torch.equal(got[i], mask(reference, words)), i
        if i < len(drafts):
            assert reference.accept_token(drafts[i])
    assert torch.equal(got[0], mask(matcher, words))  # the row's own matcher did not move
