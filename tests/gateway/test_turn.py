"""The one turn pipeline (gateway/server/turn.py, turn_stream.py, turn_writer.py) against the live
gateway on the real default model: every surface reads the same generated call, and a text
completion of several prompts with n choices each comes back on the right indices."""

from __future__ import annotations

import json

import pytest

pytestmark = pytest.mark.slow

PARAMETERS = {
    "type": "object",
    "properties": {"city": {"type": "string", "maxLength": 24},
                   "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
    "required": ["city", "unit"],
}
QUESTION = "What is the weather in Paris right now?"
GREEDY = {"temperature": 0, "max_tokens": 60}


def sse_data(text: str) -> list[dict]:
    return [json.loads(line[6:]) for line in text.splitlines()
            if line.startswith("data: ") and line != "data: [DONE]"]


def test_every_surface_reads_the_same_call(client):
    """Same prompt and grammar, greedy: chat (whole and streamed), Responses and Messages give
    the same call, because one parser reads every surface's output."""
    tool = {"type": "function", "function": {"name": "get_weather", "parameters": PARAMETERS}}
    chat = {"messages": [{"role": "user", "content": QUESTION}], "tools": [tool],
            "tool_choice": "required", "parallel_tool_calls": False, **GREEDY}
    whole = client.post("/v1/chat/completions", json=chat).json()["choices"][0]
    call = whole["message"]["tool_calls"][0]["function"]
    assert whole["finish_reason"] == "tool_calls" and call["name"] == "get_weather"

    streamed = client.post("/v1/chat/completions", json={**chat, "stream": True}).text
    pieces = [tc["function"].get("arguments", "") for chunk in sse_data(streamed)
              for choice in chunk["choices"] for tc in choice["delta"].get("tool_calls", [])]
    assert "".join(pieces) == call["arguments"]

    response = client.post("/v1/responses", json={
        "input": QUESTION, "tool_choice": "required", "parallel_tool_calls": False,
        "tools": [{"type": "function", "name": "get_weather", "parameters": PARAMETERS}],
        "temperature": 0, "max_output_tokens": 60}).json()
    (item,) = [i for i in response["output"] if i["type"] == "function_call"]
    assert (item["name"], item["arguments"]) == (call["name"], call["arguments"])

    message = client.post("/v1/messages", json={
        "messages": [{"role": "user", "content": QUESTION}],
        "tools": [{"name": "get_weather", "input_schema": PARAMETERS}],
        "tool_choice": {"type": "any", "disable_parallel_tool_use": True}, **GREEDY}).json()
    (block,) = [b for b in message["content"] if b["type"] == "tool_use"]
    assert message["stop_reason"] == "tool_use"
    assert (block["name"], block["input"]) == (call["name"], json.loads(call["arguments"]))


def test_completions_of_several_prompts_with_n_choices(client):
    """Choice i of prompt p is index p * n + i, streamed as whole; usage sums every prompt."""
    body = {"prompt": ["The sky is", "Two plus two is"], "n": 2, "max_tokens": 5,
            "temperature": 0}
    whole = client.post("/v1/completions", json=body).json()
    assert sorted(c["index"] for c in whole["choices"]) == [0, 1, 2, 3]
    texts = {c["index"]: c["text"] for c in whole["choices"]}
    assert texts[0] == texts[1] and texts[2] == texts[3]  # greedy: n copies of one answer

    streamed = client.post("/v1/completions", json={
        **body, "stream": True, "stream_options": {"include_usage": True}}).text
    chunks = sse_data(streamed)
    pieces: dict[int, str] = {}
    finishes: dict[int, str] = {}
    for chunk in chunks:
        for choice in chunk["choices"]:
            pieces[choice["index"]] = pieces.get(choice["index"], "") + choice["text"]
            if choice["finish_reason"]:
                finishes[choice["index"]] = choice["finish_reason"]
    assert pieces == texts and sorted(finishes) == [0, 1, 2, 3]
    usage = chunks[-1]["usage"]
    assert usage["prompt_tokens"] == whole["usage"]["prompt_tokens"]
    assert usage["completion_tokens"] == whole["usage"]["completion_tokens"]
