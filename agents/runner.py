"""Run a swarm workload against one OpenAI-compatible server: async streaming HTTP, one record
per request.

Each agent arrives at its start time and runs its turns back to back; a semaphore caps requests
in flight. Requests stream ``/v1/chat/completions`` with usage included; a failed request
(unreachable, HTTP error, malformed SSE, hang-up, timeout) is recorded with its error and the
agent carries on with whatever reply text arrived, so one bad response never ends the run and
both sides of a comparison send the same number of requests. After the run, every sent prompt is
tokenised with the server's ``POST /tokenize`` to compute the ideal hit rate (``agents.ideal``).
"""

from __future__ import annotations

import asyncio
import itertools
import json
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import NamedTuple

import httpx

from prefixgate.agents.ideal import SentPrompt, ideal_hits
from prefixgate.agents.workload import Agent, SwarmConfig, Workload


class Endpoint(NamedTuple):
    """Where to send the swarm: a server root (``/v1`` suffix tolerated), key and model name."""

    label: str
    base_url: str
    api_key: str = "EMPTY"
    model: str | None = None  # None: the workload config's, else the server's first model

    @property
    def root(self) -> str:
        root = self.base_url.rstrip("/")
        return root[: -len("/v1")] if root.endswith("/v1") else root


@dataclass(slots=True)
class RequestRecord:
    """What happened to one request (times in seconds; token counts as the server reported)."""

    agent_id: str
    group: int
    turn: int
    send_index: int  # global order in which requests were sent
    start_s: float  # send time since the run started
    ttft_s: float | None = None  # to the first generated text
    itl_s: list[float] = field(default_factory=list)  # between streamed chunks after the first
    e2e_s: float | None = None
    prompt_tokens: int | None = None  # usage.prompt_tokens
    completion_tokens: int | None = None  # usage.completion_tokens
    cached_tokens: int | None = None  # usage.prompt_tokens_details.cached_tokens (None: absent)
    output_chunks: int = 0  # SSE chunks that carried output
    finish_reason: str | None = None
    status: int | None = None  # HTTP status, None if no response
    error_kind: str | None = None  # connect | timeout | http_<code> | bad_sse | disconnected
    #                                | truncated | stream_error | transport
    error: str | None = None
    tokenized_len: int | None = None  # prompt length from /tokenize
    ideal_tokens: int | None = None  # see agents.ideal
    ideal_block_tokens: int | None = None

    @property
    def ok(self) -> bool:
        return self.error_kind is None

    def to_dict(self) -> dict:
        return asdict(self)


@dataclass(slots=True)
class RunResult:
    """One whole run of a workload against one endpoint."""

    label: str
    url: str
    wall_s: float
    records: list[RequestRecord]  # in send order
    tokenize: str  # "ok", or why the ideal hit rate is unknown
    model: str | None = None  # the model name sent (None: omitted)


class _BadStream(Exception):
    """The response is not the SSE stream of chat-completion chunks it should be."""

    def __init__(self, kind: str, message: str) -> None:
        super().__init__(message)
        self.kind = kind


def _error_message(raw: bytes) -> str:
    """The message of an OpenAI error envelope, or the start of whatever the body was."""
    try:
        body = json.loads(raw)
        return str(body["error"]["message"])
    except (ValueError, KeyError, TypeError):
        return raw[:200].decode("utf-8", "replace")


def _apply_chunk(chunk: object, record: RequestRecord, reply: list[str]) -> bool:
    """Fold one chunk into the record; True when it carried output."""
    if not isinstance(chunk, dict):
        raise _BadStream("bad_sse", f"chunk is not a JSON object: {chunk!r:.80}")
    if "error" in chunk:
        error = chunk["error"]
        message = error.get("message") if isinstance(error, dict) else error
        raise _BadStream("stream_error", str(message))
    produced = False
    for choice in chunk.get("choices") or []:
        delta = choice.get("delta") or {}
        if delta.get("content"):
            reply.append(delta["content"])
            produced = True
        # Native tool calls are kept as text so the next turn's history still carries them.
        for call in delta.get("tool_calls") or []:
            function = call.get("function") or {}
            text = (function.get("name") or "") + (function.get("arguments") or "")
            if text:
                reply.append(text)
                produced = True
        if choice.get("finish_reason"):
            record.finish_reason = choice["finish_reason"]
    read_usage(chunk, record)
    return produced


def read_usage(chunk: dict, record: object) -> None:
    """Copy a chunk's OpenAI ``usage`` (prompt, completion and cached tokens) onto ``record``
    (any object with ``prompt_tokens``, ``completion_tokens`` and ``cached_tokens``)."""
    usage = chunk.get("usage")
    if isinstance(usage, dict):
        record.prompt_tokens = usage.get("prompt_tokens")  # type: ignore[attr-defined]
        record.completion_tokens = usage.get("completion_tokens")  # type: ignore[attr-defined]
        details = usage.get("prompt_tokens_details")
        if isinstance(details, dict) and details.get("cached_tokens") is not None:
            record.cached_tokens = int(details["cached_tokens"])  # type: ignore[attr-defined]


async def _stream(client: httpx.AsyncClient, body: dict, headers: dict,
                  record: RequestRecord) -> str:
    """Send one streaming request, filling ``record``; returns the reply text received."""
    reply: list[str] = []
    start = last = time.perf_counter()
    try:
        async with client.stream("POST", "/v1/chat/completions", json=body,
                                 headers=headers) as response:
            record.status = response.status_code
            if response.status_code >= 400:
                raise _BadStream(f"http_{response.status_code}",
                                 _error_message(await response.aread()))
            done = False
            async for line in response.aiter_lines():
                if not line or line.startswith((":", "event:", "id:", "retry:")):
                    continue  # blank separators, comments (keep-alives) and other SSE fields
                if not line.startswith("data:"):
                    raise _BadStream("bad_sse", f"not an SSE data line: {line[:80]!r}")
                data = line[len("data:"):].strip()
                if data == "[DONE]":
                    done = True
                    break
                try:
                    chunk = json.loads(data)
                except ValueError as exc:
                    raise _BadStream("bad_sse", f"invalid JSON in SSE data: {data[:80]!r}") from exc
                try:
                    produced = _apply_chunk(chunk, record, reply)
                except (AttributeError, TypeError, ValueError) as exc:  # JSON of the wrong shape
                    raise _BadStream("bad_sse", f"malformed chunk: {data[:80]!r}") from exc
                if produced:
                    now = time.perf_counter()
                    if record.ttft_s is None:
                        record.ttft_s = now - start
                    else:
                        record.itl_s.append(now - last)
                    last = now
                    record.output_chunks += 1
            if not done:
                raise _BadStream("truncated", "stream ended without data: [DONE]")
    except _BadStream as exc:
        record.error_kind, record.error = exc.kind, str(exc)
    except httpx.TimeoutException as exc:
        record.error_kind, record.error = "timeout", f"{type(exc).__name__}: {exc}"
    except httpx.ConnectError as exc:
        record.error_kind, record.error = "connect", f"{type(exc).__name__}: {exc}"
    except (httpx.RemoteProtocolError, httpx.ReadError) as exc:
        record.error_kind, record.error = "disconnected", f"{type(exc).__name__}: {exc}"
    except httpx.HTTPError as exc:
        record.error_kind, record.error = "transport", f"{type(exc).__name__}: {exc}"
    record.e2e_s = time.perf_counter() - start
    return "".join(reply)


async def _served_model(client: httpx.AsyncClient) -> str | None:
    """The first model id of ``GET /v1/models``; None (omit ``model``) when there is none."""
    try:
        response = await client.get("/v1/models")
        return str(response.json()["data"][0]["id"]) if response.status_code == 200 else None
    except (httpx.HTTPError, ValueError, KeyError, IndexError, TypeError):
        return None  # unreachable or odd: the chat requests will report the real error


async def _tokenize(client: httpx.AsyncClient, sent: list[tuple[list[dict], tuple[dict, ...]]],
                    concurrency: int) -> list[list[int]] | str:
    """Token ids of every sent prompt via ``POST /tokenize``, or why they are unavailable."""

    async def one(messages: list[dict], tools: tuple[dict, ...]) -> list[int]:
        body: dict = {"messages": messages}
        if tools:
            body["tools"] = list(tools)
        response = await client.post("/tokenize", json=body)
        if response.status_code != 200:
            raise ValueError(f"HTTP {response.status_code}: {_error_message(response.content)}")
        payload = response.json()
        tokens = payload.get("tokens") if isinstance(payload, dict) else None
        if not isinstance(tokens, list):
            raise ValueError("the response has no 'tokens' list")
        return tokens

    limit = asyncio.Semaphore(concurrency)

    async def bounded(messages: list[dict], tools: tuple[dict, ...]) -> list[int]:
        async with limit:
            return await one(messages, tools)

    try:
        first = await one(*sent[0])  # probe once before fanning out
        rest = await asyncio.gather(*(bounded(*item) for item in sent[1:]))
    except httpx.HTTPError as exc:
        return f"POST /tokenize failed: {type(exc).__name__}: {exc}"
    except ValueError as exc:  # an error status, or not the JSON it should be
        return f"POST /tokenize failed: {exc}"
    return [first, *rest]


async def run_workload(workload: Workload, endpoint: Endpoint, *, page_size: int = 16,
                       timeout_s: float = 300.0, tokenize: bool = True,
                       on_request_done: Callable[[RequestRecord], None] | None = None
                       ) -> RunResult:
    """Run every agent of ``workload`` against ``endpoint``.

    Args:
        workload: the swarm (see ``agents.workload.build_workload``).
        endpoint: server root, API key and model.
        page_size: block size for the block-level ideal hit.
        timeout_s: connect/read/write timeout of each request.
        tokenize: fetch token ids after the run for the ideal hit rate.
        on_request_done: called after every request (progress bars).

    Returns:
        A ``RunResult``; errors are in the records, never raised.
    """
    config = workload.config
    headers = {"Authorization": f"Bearer {endpoint.api_key}"}
    limits = httpx.Limits(max_connections=config.concurrency + 4)
    semaphore = asyncio.Semaphore(config.concurrency)
    send_order = itertools.count()
    sent: list[tuple[list[dict], tuple[dict, ...]]] = []
    records: list[RequestRecord] = []

    async with httpx.AsyncClient(base_url=endpoint.root, headers=headers, limits=limits,
                                 timeout=httpx.Timeout(timeout_s)) as client:
        model = endpoint.model or config.model or await _served_model(client)
        t0 = time.perf_counter()

        async def run_agent(agent: Agent) -> None:
            await asyncio.sleep(max(0.0, t0 + agent.start_s - time.perf_counter()))
            replies: list[str] = []
            for turn in range(agent.turns):
                messages = agent.messages(replies)
                body = _turn_body(agent, messages, config, model)
                async with semaphore:
                    record = RequestRecord(agent_id=agent.agent_id, group=agent.group, turn=turn,
                                           send_index=next(send_order),
                                           start_s=time.perf_counter() - t0)
                    sent.append((messages, agent.tools))
                    reply = await _stream(client, body, {"X-Agent-Id": agent.agent_id}, record)
                records.append(record)
                if on_request_done is not None:
                    on_request_done(record)
                replies.append(reply)

        await asyncio.gather(*(run_agent(agent) for agent in workload.agents))
        wall_s = time.perf_counter() - t0
        records.sort(key=lambda r: r.send_index)
        status = "skipped"
        if tokenize:
            status = await _tokenize_ideal(client, sent, records, config.concurrency, page_size)
    return RunResult(label=endpoint.label, url=endpoint.root, wall_s=wall_s, records=records,
                     tokenize=status, model=model)


def _turn_body(agent: Agent, messages: list[dict], config: SwarmConfig,
               model: str | None) -> dict:
    """The chat/completions body of one turn: streamed, with usage, tagged with the agent."""
    body = {"messages": messages, "max_tokens": config.max_tokens,
            "temperature": config.temperature, "stream": True,
            "stream_options": {"include_usage": True}, "user": agent.agent_id}
    if model is not None:
        body["model"] = model
    if agent.tools:
        body["tools"] = list(agent.tools)
    return body


async def _tokenize_ideal(client: httpx.AsyncClient, sent: list[tuple[list[dict], tuple[dict, ...]]],
                          records: list[RequestRecord], concurrency: int, page_size: int) -> str:
    """Tokenise what was sent and fill each record's ideal hit; returns the tokenize status
    ("ok" or what failed)."""
    token_ids = await _tokenize(client, sent, concurrency)
    if isinstance(token_ids, str):
        return token_ids
    _fill_ideal(records, token_ids, page_size)
    return "ok"


def _fill_ideal(records: list[RequestRecord], token_ids: list[list[int]], page_size: int) -> None:
    """Set the tokenised length and ideal hits of every record (records in send order)."""
    last_of_agent: dict[str, int] = {}
    prompts = []
    for record, tokens in zip(records, token_ids, strict=True):
        generated = record.completion_tokens
        if generated is None:
            # A lower bound (a chunk holds one token or more); servers without usage
            # rarely serve /tokenize anyway.
            generated = record.output_chunks
        prompts.append(SentPrompt(tokens, generated, last_of_agent.get(record.agent_id)))
        last_of_agent[record.agent_id] = record.send_index
    hits = ideal_hits(prompts, page_size)
    for record, tokens, hit, block in zip(records, token_ids, hits.tokens, hits.blocks,
                                          strict=True):
        record.tokenized_len = len(tokens)
        record.ideal_tokens = hit
        record.ideal_block_tokens = block
