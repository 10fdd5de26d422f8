"""The pure side of the trace replay (benchmarks.trace): read a Mooncake FAST'25-format JSONL
trace, rebuild its sessions from the hash prefixes, pick some, and scale them into requests
of token ids with a send schedule. No HTTP, no tokenizer: the same arguments give the same
requests, token for token.

The format (../shared/traces/README.md): one JSON object a line with ``timestamp`` (ms),
``input_length``, ``output_length`` and ``hash_ids`` (one id per ``trace_block``-token block of
the prompt, the last one possibly partial; equal ids are equal blocks).
"""

from __future__ import annotations

import json
import math
import random
from dataclasses import dataclass
from pathlib import Path

TRACE_BLOCK = 512  # tokens per hash id in the Mooncake traces
# Token ids drawn for the blocks: clear of SmolLM2's special tokens (0-16) and inside every
# vocabulary the peers serve the same weights with.
TOKEN_LOW, TOKEN_HIGH = 1_000, 40_000


class TraceError(ValueError):
    """A trace line that does not follow the format (the message names the line)."""


@dataclass(frozen=True, slots=True)
class TraceRequest:
    """One line of the trace."""

    index: int  # line number from 0
    timestamp_ms: int
    input_length: int
    output_length: int
    hash_ids: tuple[int, ...]

    def full_blocks(self, trace_block: int) -> tuple[int, ...]:
        """The hash ids of the prompt's full blocks (the only ones a continuation repeats)."""
        return self.hash_ids[: self.input_length // trace_block]


@dataclass(frozen=True, slots=True)
class Link:
    """Where a request sits in its session: the request it continues and how deep it is."""

    parent: int | None  # index of the request it continues; None opens a session
    session: int  # index of the session's first request
    turn: int  # 0 for the first request of a session


def _parse_line(number: int, line: str, trace_block: int) -> TraceRequest:
    try:
        row = json.loads(line)
        request = TraceRequest(number, int(row["timestamp"]), int(row["input_length"]),
                               int(row["output_length"]), tuple(int(h) for h in row["hash_ids"]))
    except (ValueError, KeyError, TypeError) as exc:
        raise TraceError(f"trace line {number + 1}: {type(exc).__name__}: {exc}") from exc
    blocks = math.ceil(request.input_length / trace_block)
    if request.input_length < 1 or request.output_length < 0 or len(request.hash_ids) != blocks:
        raise TraceError(f"trace line {number + 1}: input_length {request.input_length} needs "
                         f"{blocks} hash ids of {trace_block} tokens, got {len(request.hash_ids)} "
                         f"(output_length {request.output_length})")
    return request


def load_trace(path: Path, trace_block: int = TRACE_BLOCK) -> list[TraceRequest]:
    """Every request of a JSONL trace, in timestamp order (blank lines skipped).

    Raises:
        TraceError: a line is not JSON, lacks a field, or its hash ids do not cover its input.
    """
    requests = [_parse_line(number, line, trace_block)
                for number, line in enumerate(path.read_text().splitlines()) if line.strip()]
    if not requests:
        raise TraceError(f"{path}: no requests")
    return sorted(requests, key=lambda r: (r.timestamp_ms, r.index))


def link_sessions(requests: list[TraceRequest], trace_block: int = TRACE_BLOCK) -> list[Link]:
    """Each request's session, rebuilt from the hashes (``requests`` in timestamp order).

    A request continues the latest earlier request whose full blocks its own hash list starts
    with, the longest such (turn n's last block is partial, so turn n+1 repeats only its full
    blocks). A request that shares a prefix without covering a whole earlier prompt (a common
    system prompt or document) opens its own session: the cache still sees the shared blocks.
    """
    by_full_blocks: dict[tuple[int, ...], int] = {}  # full blocks -> position in ``requests``
    links: list[Link] = []
    for position, request in enumerate(requests):
        parent = None
        for length in range(len(request.hash_ids), 0, -1):
            parent = by_full_blocks.get(request.hash_ids[:length])
            if parent is not None:
                break
        if parent is None:
            links.append(Link(None, position, 0))
        else:
            links.append(Link(parent, links[parent].session, links[parent].turn + 1))
        full = request.full_blocks(trace_block)
        if full:
            by_full_blocks[full] = position
    return links


@dataclass(frozen=True, slots=True)
class Selection:
    """Which sessions to replay."""

    sessions: int = 48  # how many (all that qualify when fewer)
    min_turns: int = 2  # sessions with fewer requests are left out
    max_turns: int = 4  # requests deeper than this in a session are dropped
    seed: int | None = None  # None: the first sessions by arrival; else a seeded sample

    def __post_init__(self) -> None:
        if self.sessions < 1 or self.min_turns < 1 or self.max_turns < 1:
            raise ValueError("sessions, min_turns and max_turns must be >= 1")


def select(requests: list[TraceRequest], links: list[Link], selection: Selection) -> list[int]:
    """Positions (into ``requests``) of the chosen sessions' requests, in timestamp order."""
    kept = [p for p, link in enumerate(links) if link.turn < selection.max_turns]
    sizes: dict[int, int] = {}
    for position in kept:
        sizes[links[position].session] = sizes.get(links[position].session, 0) + 1
    eligible = sorted(s for s, n in sizes.items() if n >= selection.min_turns)
    if selection.seed is None:
        chosen = set(eligible[: selection.sessions])
    else:
        count = min(selection.sessions, len(eligible))
        chosen = set(random.Random(selection.seed).sample(eligible, count))
    return [p for p in kept if links[p].session in chosen]


@dataclass(frozen=True, slots=True)
class Scaling:
    """How trace lengths and times become the replay's."""

    scale: int = 32  # lengths / scale: 512-token blocks become 16 tokens
    output_scale: float = 1.0  # output lengths / output_scale
    max_output: int = 256  # cap on a request's output tokens
    time_scale: float = 0.1  # trace seconds x time_scale = replay seconds
    trace_block: int = TRACE_BLOCK
    token_seed: int = 0

    def __post_init__(self) -> None:
        if self.scale < 1 or self.trace_block % self.scale:
            raise ValueError(f"scale must divide the trace block ({self.trace_block}), "
                             f"got {self.scale}")
        if self.output_scale <= 0 or self.max_output < 1 or self.time_scale < 0:
            raise ValueError("output_scale must be > 0, max_output >= 1, time_scale >= 0")

    @property
    def block_tokens(self) -> int:
        return self.trace_block // self.scale


def block_token_ids(hash_id: int, block_tokens: int, token_seed: int = 0) -> list[int]:
    """The token ids standing for one hash id: the same id always gives the same block."""
    rng = random.Random(f"trace-block/{token_seed}/{hash_id}")
    return [rng.randrange(TOKEN_LOW, TOKEN_HIGH) for _ in range(block_tokens)]


def prompt_token_ids(request: TraceRequest, scaling: Scaling) -> list[int]:
    """The request's prompt: its blocks' token ids, the last block cut to the scaled length
    (at least one token of it, so every hash id shows). NOTE: rounded down, so a partial trace
    block never becomes a full replay block that its continuation would not repeat."""
    size = scaling.block_tokens
    blocks = len(request.hash_ids)
    length = min(max(request.input_length // scaling.scale, (blocks - 1) * size + 1),
                 blocks * size)
    ids: list[int] = []
    for hash_id in request.hash_ids:
        ids.extend(block_token_ids(hash_id, size, scaling.token_seed))
    return ids[:length]


@dataclass(frozen=True, slots=True)
class ReplayRequest:
    """One request of the replay, scaled."""

    id: int  # position in the replay
    trace_index: int  # its line in the trace
    session: int  # id of its session in the replay (0..)
    parent: int | None  # id of the request it continues
    turn: int
    prompt: tuple[int, ...]
    max_tokens: int
    at_s: float  # open loop: send time from the replay's start
    gap_s: float  # closed loop: pause after its parent finished (0 for a first turn)


def build_replay(requests: list[TraceRequest], links: list[Link], positions: list[int],
                 scaling: Scaling) -> list[ReplayRequest]:
    """The chosen requests, scaled, with their send times (from the first one's timestamp)."""
    if not positions:
        return []
    start_ms = requests[positions[0]].timestamp_ms
    ids = {position: n for n, position in enumerate(positions)}
    sessions: dict[int, int] = {}
    replay = []
    for n, position in enumerate(positions):
        request, link = requests[position], links[position]
        session = sessions.setdefault(link.session, len(sessions))
        parent = ids.get(link.parent) if link.parent is not None else None
        gap_ms = (request.timestamp_ms - requests[link.parent].timestamp_ms
                  if parent is not None else 0)
        output = max(1, min(round(request.output_length / scaling.output_scale),
                            scaling.max_output))
        replay.append(ReplayRequest(
            n, request.index, session, parent, link.turn, tuple(prompt_token_ids(request, scaling)),
            output, (request.timestamp_ms - start_ms) / 1000 * scaling.time_scale,
            gap_ms / 1000 * scaling.time_scale))
    return replay


def closed_loop_floor(replay: list[ReplayRequest]) -> float:
    """The closed loop's wall with a server that answers at once: the longest chain of a
    first turn's send time plus its session's pauses (the part of the wall no server shortens)."""
    ready: dict[int, float] = {}
    for request in replay:  # parents come first (timestamp order)
        base = request.at_s if request.parent is None else ready[request.parent]
        ready[request.id] = base + request.gap_s
    return max(ready.values(), default=0.0)


def describe(replay: list[ReplayRequest], block_tokens: int) -> dict[str, float | int]:
    """Workload figures: requests, sessions, prompt and output tokens, the working set (distinct
    full blocks, each with its whole prefix, plus every partial tail) and the share of prompt
    tokens a cache that never evicts could serve."""
    chain_ids: dict[tuple[int, tuple[int, ...]], int] = {}  # (parent block's id, tokens) -> id
    tails = 0
    for request in replay:
        parent = -1
        full = len(request.prompt) // block_tokens * block_tokens
        for start in range(0, full, block_tokens):
            key = (parent, request.prompt[start:start + block_tokens])
            parent = chain_ids.setdefault(key, len(chain_ids))
        tails += len(request.prompt) - full
    prompt = sum(len(r.prompt) for r in replay)
    working_set = len(chain_ids) * block_tokens + tails
    return {"requests": len(replay), "sessions": len({r.session for r in replay}),
            "returning_requests": sum(r.parent is not None for r in replay),
            "prompt_tokens": prompt, "output_tokens": sum(r.max_tokens for r in replay),
            "working_set_tokens": working_set,
            "reusable_fraction": 1 - working_set / prompt if prompt else 0.0}
