"""Chat rendering with the model's own template vs transformers' apply_chat_template."""

from __future__ import annotations

import pytest

from prefixgate.engine.chat_template import ChatTemplate, ChatTemplateError
from prefixgate.engine.tokenizer import Tokenizer

pytestmark = pytest.mark.slow

WEATHER_TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Current weather for a city",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string", "description": "e.g. Paris <FR> & co"}},
            "required": ["city"],
        },
    },
}

CONVERSATIONS = [
    [{"role": "user", "content": "What is 2 + 2?"}],
    [
        {"role": "system", "content": "You are terse."},
        {"role": "user", "content": "Name a colour."},
    ],
    [
        {"role": "system", "content": "You are an agent."},
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": "Calling the tool."},
        {"role": "tool", "content": '{"temp_c": 21, "sky": "clear"}'},
        {"role": "user", "content": "Thanks! Und auf Deutsch? 日本語も。"},
    ],
    [{"role": "user", "content": "  spaces\n\nand\ttabs  "}],
]

# exercises the helpers HF templates use: tools, tojson (no HTML escaping), raise_exception,
# loop controls, namespace, strftime_now, bos/eos tokens, {% generation %}
AGENT_TEMPLATE = """{{ bos_token }}
{%- if tools %}<tools>{% for t in tools %}{{ t | tojson }}{% endfor %}</tools>{% endif %}
{%- set ns = namespace(turns=0) %}
{%- for m in messages %}
  {%- if m.role not in ["system", "user", "assistant", "tool"] %}
    {{- raise_exception("bad role " ~ m.role) }}
  {%- endif %}
  {%- if m.role == "tool" and ns.turns > 99 %}{% break %}{% endif %}
  {%- set ns.turns = ns.turns + 1 %}
<|{{ m.role }}|>
{%- if m.role == "assistant" %}{% generation %}{{ m.content }}{% endgeneration %}
{%- else %}{{ m.content }}{% endif %}{{ eos_token }}
{%- endfor %}
{%- if add_generation_prompt %}
<|assistant|>{{ "[" ~ (strftime_now("%Y") | length) ~ "]" }}
{%- endif %}"""


@pytest.mark.parametrize("messages", CONVERSATIONS)
@pytest.mark.parametrize("add_generation_prompt", [True, False])
def test_render_matches_transformers(tokenizer, hf_tokenizer, messages, add_generation_prompt):
    ours = tokenizer.render_chat(messages, add_generation_prompt=add_generation_prompt)
    theirs = hf_tokenizer.apply_chat_template(
        messages, tokenize=False, add_generation_prompt=add_generation_prompt
    )
    assert ours == theirs
    ids = tokenizer.apply_chat_template(messages, add_generation_prompt=add_generation_prompt)
    hf_ids = hf_tokenizer.apply_chat_template(
        messages, tokenize=True, add_generation_prompt=add_generation_prompt, return_dict=False
    )
    assert ids == list(hf_ids)


@pytest.mark.parametrize("messages", CONVERSATIONS[1:3])
def test_custom_template_with_tools_matches_transformers(tokenizer, hf_tokenizer, messages):
    template = ChatTemplate(
        AGENT_TEMPLATE, bos_token=tokenizer.bos_token, eos_token=tokenizer.eos_token
    )
    ours = template.render(messages, tools=[WEATHER_TOOL])
    theirs = hf_tokenizer.apply_chat_template(
        messages,
        tools=[WEATHER_TOOL],
        chat_template=AGENT_TEMPLATE,
        tokenize=False,
        add_generation_prompt=True,
    )
    assert ours == theirs
    assert '"e.g. Paris <FR> & co"' in ours  # tojson keeps <, >, & verbatim
    assert ours.endswith("<|assistant|>[4]")


def test_template_raise_exception_is_a_clear_error(tokenizer):
    template = ChatTemplate(AGENT_TEMPLATE, bos_token="<s>", eos_token="</s>")
    with pytest.raises(ChatTemplateError, match="bad role robot"):
        template.render([{"role": "robot", "content": "beep"}])


def test_messages_are_validated(tokenizer):
    with pytest.raises(ChatTemplateError, match="non-empty list"):
        tokenizer.render_chat([])
    with pytest.raises(ChatTemplateError, match="'role'"):
        tokenizer.render_chat([{"content": "no role"}])
    with pytest.raises(ChatTemplateError, match="tools"):
        tokenizer.render_chat(CONVERSATIONS[0], tools=["not a schema"])  # type: ignore[list-item]


def test_caller_messages_are_not_mutated(tokenizer):
    messages = [{"role": "user", "content": "hi"}]
    snapshot = [dict(m) for m in messages]
    tokenizer.render_chat(messages)
    assert messages == snapshot


def test_template_runs_sandboxed():
    escape = ChatTemplate("{{ messages.__class__.__mro__ }}")
    with pytest.raises(ChatTemplateError):
        escape.render([{"role": "user", "content": "x"}])
    mutate = ChatTemplate("{% set _ = messages.append(1) %}ok")
    with pytest.raises(ChatTemplateError):
        mutate.render([{"role": "user", "content": "x"}])


def test_broken_or_missing_template_is_a_clear_error(tokenizer):
    with pytest.raises(ChatTemplateError, match="does not parse"):
        ChatTemplate("{% for m in messages %}{{ m.content }")
    with pytest.raises(ChatTemplateError, match="empty"):
        ChatTemplate("   ")
    no_template = Tokenizer(tokenizer.backend, eos_token_ids=tokenizer.eos_token_ids)
    with pytest.raises(ChatTemplateError, match="no chat template"):
        no_template.apply_chat_template(CONVERSATIONS[0])
