"""formats/reasoning.py with SmolLM3's template: its ``/think`` / ``/no_think`` system flags
and ``enable_thinking`` (what every surface's reasoning controls become) switch the span."""

from __future__ import annotations

from prefixgate.engine.chat_template import ChatTemplate
from prefixgate.gateway.server.tools.formats.reasoning import (
    THINK,
    reasoning_for_template,
    split_reasoning,
    starts_inside,
    thinking_kwargs,
)
from tests.family_fixtures import template

HI = [{"role": "user", "content": "hi"}]
EMPTY_SPAN = "<|im_start|>assistant\n<think>\n\n</think>\n"


def _system(text: str) -> list[dict[str, str]]:
    return [{"role": "system", "content": text}, *HI]


def test_smollm3_thinking_on_and_off():
    source = template("HuggingFaceTB-SmolLM3-3B.jinja")
    assert reasoning_for_template(source) is THINK
    smol = ChatTemplate(source)
    on, off = smol.render(HI, **thinking_kwargs(True)), smol.render(HI, **thinking_kwargs(False))
    assert "Reasoning Mode: /think\n" in on and on.endswith("<|im_start|>assistant\n")
    # off: the prompt carries the empty span, so the output is all answer
    assert "Reasoning Mode: /no_think\n" in off and off.endswith(EMPTY_SPAN)
    assert not starts_inside(THINK, on) and not starts_inside(THINK, off)
    assert smol.render(HI, **thinking_kwargs(None, "none")) == off  # reasoning_effort "none"
    assert smol.render(HI) == on  # the template's default: thinking
    # the system flags switch it too (and win over the request's switch), and are cut out
    flagged = smol.render(_system("Be brief. /no_think"))
    assert flagged.endswith(EMPTY_SPAN)
    assert "## Custom Instructions\n\nBe brief.\n\n<|im_end|>" in flagged
    assert smol.render(_system("Be brief. /think"), **thinking_kwargs(False)).endswith(
        "<|im_start|>assistant\n"
    )
    thought = "<think>\nThe user greets me.\n</think>\nHello!"
    assert split_reasoning(thought) == ("\nThe user greets me.\n", "Hello!")
    assert split_reasoning("Hello!") == ("", "Hello!")
