"""The tool loop keeps extending its tokens with each family's real template.

An agent's turn t is its prompt plus what the model wrote (a call in the template's format,
with the grammar's canonical JSON, then the end-of-turn token); turn t+1 re-renders the whole
history with the template. The prefix cache can serve turn t+1 only as far as the two agree:
achieved / ideal = common prefix / (prompt_t + output_t), summed over a 4-turn loop. Every
agent of a swarm repeats the same arithmetic, so one agent's ratio is the swarm's.
"""

from __future__ import annotations

import json

import pytest

from prefixgate.engine.loader.hf import _load_tokenizer
from prefixgate.gateway.server.tools.formats import format_for_template
from tests.family_fixtures import family_fixture

TOOLS = [{"type": "function", "function": {
    "name": "read_file", "description": "Read a file",
    "parameters": {"type": "object", "properties": {"path": {"type": "string"}},
                   "required": ["path"]}}}]  # fmt: skip
TURNS = 4
# (fixture, end-of-turn text after a call, think before the call)
CASES = {
    "qwen3": ("qwen3", "<|im_end|>", False),
    "qwen3-thinking": ("qwen3", "<|im_end|>", True),
    "qwen3-coder": ("qwen3_moe", "<|im_end|>", False),
    "llama3.1": ("llama3", "<|eot_id|>", False),
}


def _call_text(fmt, args: dict[str, str]) -> str:
    if fmt.name == "qwen3_coder":
        body = "".join(f"<parameter={k}>\n{v}\n</parameter>\n" for k, v in args.items())
        return fmt.begin("read_file") + body + fmt.end
    return fmt.begin("read_file") + json.dumps(args, ensure_ascii=False) + fmt.end


def tool_loop_hit_ratio(tokenizer, end_of_turn: str, think: bool) -> float:
    fmt = format_for_template(tokenizer.chat_template.source)
    history = [{"role": "system", "content": "You are a coding agent."},
               {"role": "user", "content": "Fix the bug in cache.py"}]  # fmt: skip
    achieved = ideal = 0
    for turn in range(TURNS):
        prompt = tokenizer.apply_chat_template(history, tools=TOOLS)
        args = {"path": f"src/file_{turn}.py"}
        reasoning = f"I need file {turn}."
        text = (f"<think>\n{reasoning}\n</think>\n\n" if think else "") + _call_text(fmt, args)
        generated = prompt + tokenizer.encode(text + end_of_turn, add_special_tokens=False)
        history = [*history,
                   {"role": "assistant", "content": "",
                    "reasoning_content": reasoning if think else None,
                    "tool_calls": [{"id": f"c{turn}", "type": "function",
                                    "function": {"name": "read_file", "arguments": args}}]},
                   {"role": "tool", "tool_call_id": f"c{turn}", "content": f"contents {turn}"}]  # fmt: skip
        following = tokenizer.apply_chat_template(history, tools=TOOLS)
        common = next(
            (i for i, (a, b) in enumerate(zip(generated, following, strict=False)) if a != b),
            min(len(generated), len(following)),
        )
        achieved, ideal = achieved + common, ideal + len(generated)
    return achieved / ideal


@pytest.mark.parametrize("case", CASES)
def test_tool_loop_extends_its_tokens(case):
    name, end_of_turn, think = CASES[case]
    tokenizer = _load_tokenizer(family_fixture(name).hf_dir)
    ratio = tool_loop_hit_ratio(tokenizer, end_of_turn, think)
    print(f"{case}: tool-loop hit/ideal {ratio:.4f}")
    assert ratio >= 0.98
