"""An agent loop on the official ``openai`` SDK pointed at prefixgate: tools, multi-turn history,
per-agent stats and cache hits.

Run it as a script (it does not import this repository's ``agents`` package):

    python agents/examples/openai_sdk_agent.py --base-url http://127.0.0.1:8000/v1 \
        --agent-id triage-1 "Why is checkout-api slow?"

Every call re-sends the same system prompt and tool schemas plus the growing history, which is
exactly the prefix prefixgate keeps in shared KV pages; the script prints how many prompt tokens
each call got from the cache (``usage.prompt_tokens_details.cached_tokens``).
"""

from __future__ import annotations

import argparse
import json
import os

from openai import OpenAI

SYSTEM = """You are an on-call assistant for an e-commerce platform. Use the tools to look at
live data before answering; never guess numbers. Reply briefly and cite the tool results."""

TOOLS = [
    {"type": "function", "function": {
        "name": "get_latency",
        "description": "p50 and p99 latency of a service over the last hour, in milliseconds.",
        "parameters": {"type": "object", "required": ["service"],
                       "properties": {"service": {"type": "string"}}}}},
    {"type": "function", "function": {
        "name": "recent_deploys",
        "description": "Deployments of a service in the last 24 hours.",
        "parameters": {"type": "object", "required": ["service"],
                       "properties": {"service": {"type": "string"}}}}},
]


def call_tool(name: str, arguments: dict) -> dict:
    """Stand-in tool implementations (a real agent would call its systems here)."""
    service = arguments.get("service", "unknown")
    if name == "get_latency":
        return {"service": service, "p50_ms": 182, "p99_ms": 2410}
    if name == "recent_deploys":
        return {"service": service, "deploys": [{"release": "v412", "at": "2025-01-07T09:12Z"}]}
    return {"error": f"unknown tool {name!r}"}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("question", nargs="?", default="Why is checkout-api slow right now?")
    parser.add_argument("--base-url", default="http://127.0.0.1:8000/v1")
    parser.add_argument("--api-key", default=os.environ.get("PREFIXGATE_API_KEY", "EMPTY"))
    parser.add_argument("--model", default="default")
    parser.add_argument("--agent-id", default="openai-sdk-agent")
    parser.add_argument("--cache-salt", help="isolate this agent's cache entries (optional)")
    parser.add_argument("--max-steps", type=int, default=4)
    args = parser.parse_args()

    client = OpenAI(base_url=args.base_url, api_key=args.api_key)
    extra_body = {"cache_salt": args.cache_salt} if args.cache_salt else None
    messages: list[dict] = [{"role": "system", "content": SYSTEM},
                            {"role": "user", "content": args.question}]
    for step in range(args.max_steps):
        response = client.chat.completions.create(
            model=args.model, messages=messages, tools=TOOLS, max_tokens=128,
            user=args.agent_id,  # per-agent stats on the gateway
            extra_headers={"X-Agent-Id": args.agent_id}, extra_body=extra_body)
        usage = response.usage
        details = getattr(usage, "prompt_tokens_details", None) if usage else None
        cached = getattr(details, "cached_tokens", None) if details else None
        print(f"step {step}: prompt_tokens={usage.prompt_tokens if usage else '?'} "
              f"cached_tokens={cached if cached is not None else 'not reported'}")
        message = response.choices[0].message
        messages.append(message.model_dump(exclude_none=True))
        if not message.tool_calls:
            print(message.content)
            return
        for call in message.tool_calls:
            try:
                arguments = json.loads(call.function.arguments or "{}")
            except json.JSONDecodeError as exc:
                result = {"error": f"arguments are not JSON: {exc}"}
            else:
                result = call_tool(call.function.name, arguments)
            messages.append({"role": "tool", "tool_call_id": call.id,
                             "content": json.dumps(result)})
    print(f"stopped after {args.max_steps} steps")


if __name__ == "__main__":
    main()
