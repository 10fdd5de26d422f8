"""A hostile chat template (from a GGUF's metadata) is bounded in time, loop range and size:
each payload fails its request alone with a clear 400, never a 500, a stall or GBs of memory
(engine/template_sandbox.py)."""

from __future__ import annotations

import time

import httpx
import pytest

from prefixgate.engine.async_engine import build_engine
from prefixgate.engine.chat_template import ChatTemplate, ChatTemplateError
from prefixgate.engine.config import EngineConfig
from prefixgate.engine.loader import load_model
from prefixgate.engine.template_sandbox import MAX_RENDER_SECONDS
from prefixgate.gateway.server import ServerSettings
from tests.engine.tiny_models import tiny_hf_model, write_gguf
from tests.live_gateway import live_servers

PAYLOADS = {
    "range": "{% for x in range(10**9) %}{{ x }}{% endfor %}",
    "nested": "{% for a in range(60000) %}{% for b in range(60000) %}{% endfor %}{% endfor %}",
    "repeat": "{{ 'A' * 10**8 }}",
    "doubling": "{% set ns = namespace(s='A') %}{% for i in range(40) %}"
                "{% set ns.s = ns.s ~ ns.s %}{% endfor %}{{ ns.s|length }}",
    "list": "{{ (['A' * 1000000] * 100000)|join }}",
    "replace": "{{ ('A' * 1000000)|replace('A', 'A' * 100) }}",
    "format": "{{ '%0999999999d' % 1 }}{{ '{:>999999999}'.format(1) }}",
    "power": "{{ 7 ** 999999999 }}",
    "messages": "{% for a in messages %}{% for b in messages %}{% for c in messages %}"
                "{% for d in messages %}{% for e in messages %}x{% endfor %}{% endfor %}{% endfor %}"
                "{% endfor %}{% endfor %}",
    "recursion": "{% macro f(n) %}{{ f(n + 1) }}{% endmacro %}{{ f(0) }}",
    "zero": "{{ 1 // 0 }}",
}
# one template, the payload chosen by the first message (a GGUF has one template)
HOSTILE = "".join(
    f"{'{% if' if i == 0 else '{% elif'} messages[0].content == '{name}' %}}{body}"
    for i, (name, body) in enumerate(PAYLOADS.items())
) + "{% else %}{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n" \
    "{% endfor %}<|im_start|>assistant\n{% endif %}"


@pytest.mark.parametrize("name", list(PAYLOADS))
def test_each_payload_is_a_clear_error_within_the_bounds(name):
    messages = [{"role": "user", "content": name}] * (24 if name == "messages" else 1)
    started = time.monotonic()
    with pytest.raises(ChatTemplateError, match="chat template"):
        ChatTemplate(HOSTILE).render(messages)
    assert time.monotonic() - started < MAX_RENDER_SECONDS + 2


def test_a_hostile_gguf_template_gets_400s_and_the_server_serves_on(tmp_path, default_gguf_path):
    path = tmp_path / "hostile.gguf"
    write_gguf(path, tiny_hf_model("llama", seed=5), default_gguf_path, chat_template=HOSTILE)
    engine = build_engine(EngineConfig(num_pages=32, page_size=16, device="cpu"),
                          loaded=load_model(path))
    settings = ServerSettings(host="127.0.0.1", port=0, log_level="warning")
    with live_servers(engine, [settings]) as servers, \
            httpx.Client(base_url=servers[0].base_url, timeout=60) as client:
        for name in ("range", "nested", "repeat", "list", "power", "zero"):
            for path_, body in (
                    ("/v1/chat/completions", {"messages": [{"role": "user", "content": name}]}),
                    ("/v1/messages", {"max_tokens": 2,
                                      "messages": [{"role": "user", "content": name}]}),
                    ("/v1/responses", {"input": name, "max_output_tokens": 2})):
                response = client.post(path_, json={**body, "max_tokens": 2} if "chat" in path_
                                       else body)
                assert response.status_code == 400, (name, path_, response.text)
                assert "chat template" in response.text, response.text
        assert client.get("/health").status_code == 200
        ok = client.post("/v1/chat/completions", json={
            "messages": [{"role": "user", "content": "hello"}], "max_tokens": 2})
        assert ok.status_code == 200, ok.text


@pytest.mark.parametrize("filter_", ["center(10**9)", "wordwrap(1)", "filesizeformat", "random"])
def test_filters_without_a_bound_are_refused_at_load(filter_):
    with pytest.raises(ChatTemplateError, match="does not parse"):
        ChatTemplate("{{ messages[0].content|" + filter_ + " }}")
