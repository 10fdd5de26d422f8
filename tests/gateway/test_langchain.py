"""LangChain's ChatOpenAI pointed at the gateway (the way agent frameworks use it)."""

from __future__ import annotations

import pytest

langchain_openai = pytest.importorskip(
    "langchain_openai", reason="langchain-openai is in the dev extra: pip install -e '.[dev]'"
)

pytestmark = pytest.mark.slow


def test_chat_openai_invoke_and_stream(gateway):
    from langchain_core.messages import HumanMessage, SystemMessage

    llm = langchain_openai.ChatOpenAI(
        base_url=gateway.open_url + "/v1",
        api_key="unused",
        model=gateway.model,
        max_tokens=6,
        temperature=0,
        max_retries=0,
    )
    messages = [SystemMessage("You are terse."), HumanMessage("Name a fruit.")]
    reply = llm.invoke(messages)
    assert isinstance(reply.content, str)
    usage = reply.usage_metadata
    assert usage is not None and usage["input_tokens"] > 0 and 1 <= usage["output_tokens"] <= 6
    assert "cache_read" in usage.get("input_token_details", {})

    chunks = list(llm.stream(messages))
    assert "".join(c.content for c in chunks) == reply.content  # greedy: same text
