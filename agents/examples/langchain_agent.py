"""A LangChain ``ChatOpenAI`` agent loop pointed at prefixgate.

Needs ``pip install langchain-openai``. Run it as a script (it does not import this repository's
``agents`` package):

    python agents/examples/langchain_agent.py --base-url http://127.0.0.1:8000/v1 \
        --agent-id lc-1 "Which of our regions has the most open tickets?"
"""

from __future__ import annotations

import argparse
import os

from langchain_core.messages import HumanMessage, SystemMessage, ToolMessage
from langchain_core.tools import tool
from langchain_openai import ChatOpenAI


@tool
def count_open_tickets(region: str) -> int:
    """Number of open support tickets in a region (eu, us or ap)."""
    return {"eu": 41, "us": 67, "ap": 12}.get(region.lower(), 0)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("question", nargs="?",
                        default="Which of our regions has the most open tickets?")
    parser.add_argument("--base-url", default="http://127.0.0.1:8000/v1")
    parser.add_argument("--api-key", default=os.environ.get("PREFIXGATE_API_KEY", "EMPTY"))
    parser.add_argument("--model", default="default")
    parser.add_argument("--agent-id", default="langchain-agent")
    parser.add_argument("--max-steps", type=int, default=4)
    args = parser.parse_args()

    llm = ChatOpenAI(
        base_url=args.base_url, api_key=args.api_key, model=args.model, max_tokens=128,
        temperature=0,
        default_headers={"X-Agent-Id": args.agent_id},  # per-agent stats on the gateway
        model_kwargs={"user": args.agent_id},
    ).bind_tools([count_open_tickets])
    messages = [SystemMessage("You are a support analyst. Use the tools; answer in one line."),
                HumanMessage(args.question)]
    for step in range(args.max_steps):
        reply = llm.invoke(messages)
        details = (reply.usage_metadata or {}).get("input_token_details", {})
        print(f"step {step}: cached prompt tokens = {details.get('cache_read', 'not reported')}")
        messages.append(reply)
        if not reply.tool_calls:
            print(reply.content)
            return
        for call in reply.tool_calls:
            result = count_open_tickets.invoke(call["args"])
            messages.append(ToolMessage(str(result), tool_call_id=call["id"]))
    print(f"stopped after {args.max_steps} steps")


if __name__ == "__main__":
    main()
