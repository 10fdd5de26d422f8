"""Grammars that used to stall or kill the server (issue 37.1), against a live server: the
recursive tool schema is a 400 in each surface's envelope on every surface, a compile past its
limit is a 400 naming it while /health and a small chat are served, and a grammar that forces
text without end decodes (drafts skip jump-forward) instead of growing the process."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
import threading

import httpx
import pytest

from prefixgate.engine.config import EngineConfig
from prefixgate.gateway.server import ServerSettings
from tests.live_gateway import live_servers, wait_idle

RECURSIVE = {"type": "object", "properties": {"a": {"$ref": "#"}}, "required": ["a"]}
ASK = [{"role": "user", "content": "Call the tool."}]
# 500 nested starred groups: a compile of over 30 s on a 2-core Xeon
SLOW_EBNF = "root ::= " + "(" * 500 + '"a"' + ' | "b")*' * 500


def openai_error(response: httpx.Response) -> dict:
    assert response.status_code == 400, response.text[:500]
    error = response.json()["error"]
    assert error["type"] == "invalid_request_error", error
    return error


def anthropic_error(response: httpx.Response) -> dict:
    assert response.status_code == 400, response.text[:500]
    body = response.json()
    assert body["type"] == "error" and body["error"]["type"] == "invalid_request_error", body
    return body["error"]


def test_the_recursive_schema_is_a_400_on_every_surface(client: httpx.Client, gateway):
    tool = {"type": "function", "function": {"name": "f", "parameters": RECURSIVE}}
    chat = {"model": gateway.model, "messages": ASK, "max_tokens": 16, "temperature": 0}
    error = openai_error(client.post("/v1/chat/completions",
                                     json={**chat, "tools": [tool], "tool_choice": "required"}))
    assert error["code"] == "schema_unsatisfiable" and "no finite value" in error["message"]
    assert error["param"] == "tools[0].function.parameters"
    error = openai_error(client.post("/v1/chat/completions", json={**chat, "response_format": {
        "type": "json_schema", "json_schema": {"name": "r", "schema": RECURSIVE}}}))
    assert error["code"] == "schema_unsatisfiable"
    error = openai_error(client.post("/v1/chat/completions", json={
        **chat, "stream": True, "tools": [tool], "tool_choice": "auto"}))
    assert error["code"] == "schema_unsatisfiable"

    error = anthropic_error(client.post("/v1/messages", json={
        "model": gateway.model, "max_tokens": 16, "messages": ASK,
        "tools": [{"name": "f", "input_schema": RECURSIVE}], "tool_choice": {"type": "any"}}))
    assert "no finite value" in error["message"]

    responses = {"model": gateway.model, "input": "Call the tool.", "max_output_tokens": 16}
    error = openai_error(client.post("/v1/responses", json={**responses, "text": {"format": {
        "type": "json_schema", "name": "r", "schema": RECURSIVE}}}))
    assert error["code"] == "schema_unsatisfiable"
    error = openai_error(client.post("/v1/responses", json={**responses, "tool_choice": "required",
        "tools": [{"type": "function", "name": "f", "parameters": RECURSIVE}]}))
    assert error["code"] == "schema_unsatisfiable"

    assert client.get("/health").status_code == 200
    small = client.post("/v1/chat/completions", json=chat)
    assert small.status_code == 200 and small.json()["choices"][0]["message"]["content"]
    stats = wait_idle(client)
    assert stats["pages_used"] == stats["pages_pinned"]


def test_a_compile_past_its_limit_is_a_400_while_others_are_served(loaded_model):
    from prefixgate.engine.async_engine import build_engine

    engine = build_engine(EngineConfig(num_pages=64, page_size=16, grammar_compile_timeout_s=4.0,
                                       grammar_workers=1), loaded=loaded_model)
    settings = ServerSettings(host="127.0.0.1", port=0, log_level="warning")
    with live_servers(engine, [settings]) as (server,):
        client = httpx.Client(base_url=server.base_url, timeout=120)
        body = {"model": server.config.app.state.server.model_name, "max_tokens": 4,
                "temperature": 0, "messages": ASK}
        slow: dict[str, httpx.Response] = {}
        thread = threading.Thread(target=lambda: slow.update(r=client.post(
            "/v1/chat/completions",
            json={**body, "response_format": {"type": "grammar", "grammar": SLOW_EBNF}})))
        thread.start()
        served = []
        while thread.is_alive():  # the compile runs in its worker: the server answers
            served.append(client.get("/health").status_code)
            served.append(client.post("/v1/chat/completions", json=body).status_code)
        thread.join()
        assert served and set(served) == {200}, served
        error = openai_error(slow["r"])
        assert error["code"] == "grammar_too_complex" and error["param"] == "response_format.grammar"
        assert "4 s" in error["message"] and "--grammar-compile-timeout" in error["message"]
        # the worker was replaced: the next grammar compiles
        ok = client.post("/v1/chat/completions", json={**body, "response_format": {
            "type": "json_schema", "json_schema": {"name": "n", "schema": {"type": "integer"}}}})
        assert ok.status_code == 200, ok.text
        int(ok.json()["choices"][0]["message"]["content"])
        failures = [float(line.rsplit(" ", 1)[1]) for line in client.get("/metrics").text.splitlines()
                    if line.startswith("prefixgate:grammar_limit_failures_total{")]
        assert failures == [1.0]


_FORCED_FOREVER = textwrap.dedent("""
    import json, resource, sys
    resource.setrlimit(resource.RLIMIT_AS, (6 << 30, 6 << 30))
    from prefixgate.engine.api import GenerationRequest, GrammarSpec, SamplingParams
    from prefixgate.engine.config import EngineConfig
    from prefixgate.engine.build import create_llm_engine
    engine, _ = create_llm_engine(EngineConfig(num_pages=64, num_speculative_tokens=4))
    prompt = tuple(engine.tokenizer.apply_chat_template(
        [{"role": "user", "content": "Write the letter a."}]))
    specs = [GrammarSpec("ebnf", 'root ::= "a" root', param="grammar"),
             GrammarSpec("json_schema", json.dumps({"type": "string", "pattern": "a*[^\\\\s\\\\S]"}))]
    for i, spec in enumerate(specs):
        out = []
        engine.add_request(GenerationRequest(prompt, SamplingParams(max_tokens=12, temperature=0),
                                             request_id=str(i), grammar=spec), out.append)
        while engine.has_work():
            engine.step()
        text = "".join(d.text for d in out)
        print(json.dumps({"text": text, "finish": out[-1].finish_reason}))
    engine.grammars.close()
    status = open("/proc/self/status").read()
    print(json.dumps({"peak_rss": int(status.split("VmHWM:")[1].split()[0]) * 1024}))
""")


def test_a_grammar_forcing_text_without_end_decodes_instead_of_growing_the_process():
    # in its own capped process: on the code before this fix, drafting asked xgrammar for the
    # forced text, which grew until the kernel killed the server
    done = subprocess.run([sys.executable, "-c", _FORCED_FOREVER], capture_output=True,
                          text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    *results, peak = [json.loads(line) for line in done.stdout.splitlines()
                      if line.startswith("{")]
    assert [r["finish"] for r in results] == ["length", "length"], results
    assert set(results[0]["text"]) == {"a"} and results[1]["text"].startswith('"a')
    # the model and a small pool; the forced text used to grow to the 6 GB cap (caught there
    # as a failed draft, so the output alone would not show it)
    assert peak["peak_rss"] < 3 << 30, peak


@pytest.mark.parametrize("kind", ["regex", "grammar"])
def test_user_regexes_and_grammars_never_jump_forward(kind):
    from prefixgate.engine.api import GrammarSpec
    from prefixgate.engine.grammar.drafts import jump_forward_allowed

    spec = GrammarSpec("ebnf" if kind == "grammar" else "regex", "x", param=kind)
    assert not jump_forward_allowed(spec)
    assert jump_forward_allowed(GrammarSpec("json_schema", json.dumps({"type": "object"})))
    assert not jump_forward_allowed(GrammarSpec("json_schema", json.dumps(
        {"type": "string", "pattern": "a*"})))
