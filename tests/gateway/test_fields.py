"""Lone surrogates and noncharacters in any string field of any surface: a 400 in the
surface's own envelope naming the field, never a 500 (gateway/server/fields.py)."""

from __future__ import annotations

import httpx
import pytest

from prefixgate.gateway.server.fields import find_unsafe_text

SURROGATE = "\\ud800"  # JSON escapes: the body itself is valid UTF-8
NONCHARACTER = "\\uffff"

# (path, body with {bad} where the hostile text goes, the param the 400 names)
CASES = [
    ("/v1/chat/completions", '{"model":"{bad}","messages":[{"role":"user","content":"hi"}]}', "model"),
    ("/v1/chat/completions", '{"messages":[{"role":"user","content":"h{bad}"}]}', "messages[0].content"),
    ("/v1/chat/completions", '{"messages":[{"role":"user","content":"hi"}],"metadata":{"{bad}":"v"}}',
     "metadata.\\ud800"),
    ("/v1/completions", '{"prompt":"a{bad}","max_tokens":2}', "prompt"),
    ("/v1/responses", '{"model":"{bad}","input":"hi"}', "model"),
    ("/v1/responses", '{"input":"hi","metadata":{"k":"v{bad}"}}', "metadata.k"),
    ("/v1/responses", '{"input":"hi","stream":true,"metadata":{"k":"{bad}"}}', "metadata.k"),
    ("/v1/responses", '{"input":[{"role":"user","content":[{"type":"input_text","text":"{bad}"}]}]}',
     "input[0].content[0].text"),
    ("/v1/messages", '{"model":"{bad}","max_tokens":2,"messages":[{"role":"user","content":"hi"}]}',
     None),
    ("/v1/messages", '{"max_tokens":2,"messages":[{"role":"user","content":"hi"}],'
                     '"metadata":{"user_id":"{bad}"}}', None),
    ("/v1/messages/count_tokens", '{"model":"{bad}","messages":[{"role":"user","content":"hi"}]}',
     None),
    ("/tokenize", '{"prompt":"{bad}"}', "prompt"),
    ("/tokenize", '{"messages":[{"role":"user","content":"{bad}"}]}', "messages[0].content"),
]


@pytest.mark.parametrize("bad", [SURROGATE, NONCHARACTER])
def test_every_surface_answers_400_in_its_envelope(client: httpx.Client, bad: str):
    for path, template, param in CASES:
        body = template.replace("{bad}", bad)
        response = client.post(path, content=body, headers={"content-type": "application/json"})
        assert response.status_code == 400, (path, body, response.text)
        error = response.json()["error"]
        assert "valid Unicode" in error["message"], (path, error)
        if path.startswith("/v1/messages"):
            assert response.json()["type"] == "error"  # Anthropic's envelope
        else:
            expected = param if bad == SURROGATE else param.replace("\\ud800", "\\uffff")
            assert error["param"] == expected, (path, error)


def test_find_unsafe_text_paths():
    assert find_unsafe_text({"a": [1, {"b": "ok"}], "c": "x\ud800"}) == ("c", "\ud800")
    assert find_unsafe_text({"a": [{"b": "\ufdd0"}]}) == ("a[0].b", "\ufdd0")
    assert find_unsafe_text({"k\U0010ffff": 1})[0] == "k\\u10ffff"
    assert find_unsafe_text({"ok": ["é", "日本", "\U0001f600", "\ufffd"]}) is None
