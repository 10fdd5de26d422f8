"""The official ``openai`` SDK (sync and async, streaming and not) against the live gateway."""

from __future__ import annotations

import asyncio
import uuid

import httpx
import openai
import pytest

from tests.gateway.conftest import shared_block_tokens

pytestmark = pytest.mark.slow


def long_system_prompt() -> str:
    """~200 tokens; a fresh nonce first, so no earlier test warmed these pages."""
    nonce = uuid.uuid4().hex[:12]
    rules = " ".join(
        f"Rule {i}: answer briefly, cite the tool you used, and never invent a file name."
        for i in range(1, 13)
    )
    return f"[{nonce}] You are agent {nonce}, a careful coding assistant. {rules}"


@pytest.fixture()
def sdk(gateway) -> openai.OpenAI:
    return openai.OpenAI(base_url=gateway.open_url + "/v1", api_key="unused", max_retries=0)


def test_models_lists_the_served_model(sdk, gateway):
    models = sdk.models.list()
    assert [m.id for m in models.data] == [gateway.model]
    # the precision it computes in (docs/precision.md): the exact fp32 default on CPU
    card = models.data[0].model_dump()
    assert (card["dtype"], card["kv_dtype"]) == ("float32", "float32")


def test_chat_non_streaming_has_usage_with_cached_tokens(sdk, gateway):
    result = sdk.chat.completions.create(
        model=gateway.model,
        messages=[{"role": "user", "content": "Say hello."}],
        max_tokens=5,
        temperature=0,
    )
    assert result.object == "chat.completion"
    assert len(result.choices) == 1
    choice = result.choices[0]
    assert choice.message.role == "assistant"
    assert isinstance(choice.message.content, str)
    assert choice.finish_reason in ("stop", "length")
    usage = result.usage
    assert usage.prompt_tokens > 0
    assert 1 <= usage.completion_tokens <= 5
    assert usage.total_tokens == usage.prompt_tokens + usage.completion_tokens
    assert usage.prompt_tokens_details is not None
    assert 0 <= usage.prompt_tokens_details.cached_tokens < usage.prompt_tokens


def test_prompt_tokens_match_tokenize(sdk, client, gateway):
    messages = [{"role": "system", "content": "Be terse."}, {"role": "user", "content": "Hi!"}]
    tokens = client.post("/tokenize", json={"messages": messages}).json()
    result = sdk.chat.completions.create(model=gateway.model, messages=messages, max_tokens=2)
    assert result.usage.prompt_tokens == tokens["count"] == len(tokens["tokens"])


def test_second_request_with_same_system_prompt_hits_the_cache(sdk, client, gateway):
    system = long_system_prompt()
    first_messages = [
        {"role": "system", "content": system},
        {"role": "user", "content": "List files."},
    ]
    second_messages = [
        {"role": "system", "content": system},
        {"role": "user", "content": "Run the tests."},
    ]
    first = sdk.chat.completions.create(model=gateway.model, messages=first_messages, max_tokens=3)
    second = sdk.chat.completions.create(
        model=gateway.model, messages=second_messages, max_tokens=3
    )

    first_ids = client.post("/tokenize", json={"messages": first_messages}).json()["tokens"]
    second_ids = client.post("/tokenize", json={"messages": second_messages}).json()["tokens"]
    shared = shared_block_tokens(first_ids, second_ids, gateway.page_size)
    assert shared >= 8 * gateway.page_size  # the system prompt really spans many blocks
    assert first.usage.prompt_tokens_details.cached_tokens == 0  # nonce: nothing warmed it
    assert second.usage.prompt_tokens_details.cached_tokens >= shared
    assert second.usage.prompt_tokens_details.cached_tokens < second.usage.prompt_tokens


def test_identical_request_reuses_all_but_the_last_token(sdk, client, gateway):
    messages = [
        {"role": "system", "content": long_system_prompt()},
        {"role": "user", "content": "Go."},
    ]
    sdk.chat.completions.create(model=gateway.model, messages=messages, max_tokens=2)
    again = sdk.chat.completions.create(model=gateway.model, messages=messages, max_tokens=2)
    prompt_tokens = again.usage.prompt_tokens
    # Full blocks only, and the last prompt token is always recomputed (its logits are needed).
    expected = min(prompt_tokens // gateway.page_size * gateway.page_size, prompt_tokens - 1)
    assert again.usage.prompt_tokens_details.cached_tokens == expected


def test_chat_streaming_with_include_usage(sdk, gateway):
    stream = sdk.chat.completions.create(
        model=gateway.model,
        messages=[{"role": "user", "content": "Count to three."}],
        max_tokens=6,
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    content_chunks = [c for c in chunks if c.choices]
    finishes = [c.choices[0].finish_reason for c in content_chunks if c.choices[0].finish_reason]
    assert finishes in (["stop"], ["length"])
    usage_chunks = [c for c in chunks if c.usage is not None]
    assert len(usage_chunks) == 1 and usage_chunks[0] is chunks[-1]
    assert chunks[-1].choices == []
    usage = chunks[-1].usage
    assert 1 <= usage.completion_tokens <= 6
    assert usage.prompt_tokens_details.cached_tokens >= 0
    text = "".join(c.choices[0].delta.content or "" for c in content_chunks)
    assert isinstance(text, str)
    assert len({c.id for c in chunks}) == 1


def test_n_choices(sdk, gateway):
    result = sdk.chat.completions.create(
        model=gateway.model,
        messages=[{"role": "user", "content": "Pick a colour."}],
        max_tokens=4,
        n=2,
        temperature=1.0,
        seed=7,
    )
    assert sorted(c.index for c in result.choices) == [0, 1]
    assert 2 <= result.usage.completion_tokens <= 8


def test_greedy_is_deterministic_and_stop_is_honoured(sdk, gateway):
    kwargs = dict(
        model=gateway.model,
        messages=[{"role": "user", "content": "Write the alphabet in lowercase."}],
        max_tokens=12,
        temperature=0,
    )
    a = sdk.chat.completions.create(**kwargs)
    b = sdk.chat.completions.create(**kwargs)
    assert a.choices[0].message.content == b.choices[0].message.content
    text = a.choices[0].message.content
    if len(text) >= 3:
        stop = text[1:3]
        stopped = sdk.chat.completions.create(**kwargs, stop=[stop])
        assert stop not in stopped.choices[0].message.content
        assert stopped.choices[0].finish_reason == "stop"


def test_chat_logprobs(sdk, gateway):
    result = sdk.chat.completions.create(
        model=gateway.model,
        messages=[{"role": "user", "content": "Hi"}],
        max_tokens=3,
        logprobs=True,
        top_logprobs=2,
    )
    content = result.choices[0].logprobs.content
    assert len(content) == result.usage.completion_tokens
    for entry in content:
        assert entry.logprob <= 0
        assert len(entry.top_logprobs) == 2


def test_content_parts_and_tool_messages(sdk, gateway, client):
    tools = [
        {
            "type": "function",
            "function": {
                "name": "read_file",
                "description": "Read a file",
                "parameters": {"type": "object", "properties": {"path": {"type": "string"}}},
            },
        }
    ]
    messages = [
        {"role": "system", "content": [{"type": "text", "text": "You use tools."}]},
        {"role": "user", "content": [{"type": "text", "text": "Open a.txt"}]},
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": "call_1",
                    "type": "function",
                    "function": {"name": "read_file", "arguments": '{"path": "a.txt"}'},
                }
            ],
        },
        {"role": "tool", "tool_call_id": "call_1", "content": "hello world"},
    ]
    result = sdk.chat.completions.create(
        model=gateway.model, messages=messages, tools=tools, tool_choice="auto", max_tokens=3
    )
    with_tools = client.post("/tokenize", json={"messages": messages, "tools": tools}).json()
    assert result.usage.prompt_tokens == with_tools["count"]
    # tool_choice="none" keeps the tool schemas out of the prompt.
    without = sdk.chat.completions.create(
        model=gateway.model, messages=messages, tools=tools, tool_choice="none", max_tokens=1
    )
    plain = client.post("/tokenize", json={"messages": messages}).json()
    # SmolLM2's template does not render tools, so the counts match here; which tools reach
    # the template is checked in test_openai_schemas.py.
    assert without.usage.prompt_tokens == plain["count"]
    same_rule = client.post(
        "/tokenize", json={"messages": messages, "tools": tools, "tool_choice": "none"}
    ).json()
    assert same_rule["tokens"] == plain["tokens"]


def test_completions_prompt_shapes(sdk, client, gateway):
    ids = client.post("/tokenize", json={"prompt": "The capital of France is"}).json()["tokens"]
    one = sdk.completions.create(
        model=gateway.model, prompt="The capital of France is", max_tokens=3
    )
    assert one.object == "text_completion"
    assert one.usage.prompt_tokens == len(ids)
    assert one.usage.prompt_tokens_details.cached_tokens >= 0

    several = sdk.completions.create(
        model=gateway.model, prompt=["One,", "Two,", "Three,"], max_tokens=2
    )
    assert sorted(c.index for c in several.choices) == [0, 1, 2]

    by_ids = sdk.completions.create(model=gateway.model, prompt=ids, max_tokens=2, temperature=0)
    assert by_ids.usage.prompt_tokens == len(ids)

    batch = sdk.completions.create(model=gateway.model, prompt=[ids, ids[:3]], max_tokens=2, n=2)
    assert sorted(c.index for c in batch.choices) == [0, 1, 2, 3]
    assert batch.usage.prompt_tokens == len(ids) + 3  # OpenAI counts a prompt once, whatever n


def test_completions_streaming_and_logprobs(sdk, gateway):
    stream = sdk.completions.create(
        model=gateway.model,
        prompt="Once upon a time",
        max_tokens=4,
        stream=True,
        stream_options={"include_usage": True},
        logprobs=2,
    )
    chunks = list(stream)
    assert chunks[-1].usage is not None and chunks[-1].choices == []
    assert chunks[-1].usage.prompt_tokens_details.cached_tokens >= 0
    tokens = [
        t
        for c in chunks
        if c.choices and c.choices[0].logprobs
        for t in c.choices[0].logprobs.tokens
    ]
    assert len(tokens) == chunks[-1].usage.completion_tokens


def test_async_client_concurrent_requests(gateway):
    asyncio.run(_async_client_concurrent_requests(gateway))


async def _async_client_concurrent_requests(gateway):
    async_sdk = openai.AsyncOpenAI(
        base_url=gateway.open_url + "/v1", api_key="unused", max_retries=0
    )

    async def one(i: int):
        return await async_sdk.chat.completions.create(
            model=gateway.model,
            messages=[{"role": "user", "content": f"Say the number {i}."}],
            max_tokens=4,
        )

    async def streamed():
        stream = await async_sdk.chat.completions.create(
            model=gateway.model,
            messages=[{"role": "user", "content": "Stream please."}],
            max_tokens=4,
            stream=True,
            stream_options={"include_usage": True},
        )
        return [chunk async for chunk in stream]

    results = await asyncio.gather(*(one(i) for i in range(4)), streamed())
    for result in results[:4]:
        assert result.usage.prompt_tokens_details is not None
        assert 1 <= result.usage.completion_tokens <= 4
    chunks = results[4]
    assert chunks[-1].usage.prompt_tokens_details is not None
    await async_sdk.close()


def test_request_id_header_round_trip(gateway):
    with httpx.Client(base_url=gateway.open_url) as c:
        fresh = c.get("/v1/models")
        assert fresh.headers["x-request-id"].startswith("req-")
        mine = c.get("/v1/models", headers={"X-Request-Id": "trace-42"})
        assert mine.headers["x-request-id"] == "trace-42"


def test_clients_may_reuse_a_request_id_concurrently(gateway):
    """The engine needs unique ids among live requests; the client's own id is only echoed."""

    async def both() -> list[httpx.Response]:
        body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 3}
        async with httpx.AsyncClient(base_url=gateway.open_url, timeout=120) as c:
            return await asyncio.gather(
                *(
                    c.post("/v1/chat/completions", json=body, headers={"X-Request-Id": "same"})
                    for _ in range(2)
                )
            )

    for response in asyncio.run(both()):
        assert response.status_code == 200, response.text
        assert response.headers["x-request-id"] == "same"
