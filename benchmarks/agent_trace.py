"""Agent-shaped sessions as a Mooncake FAST'25-format JSONL trace, for benchmarks.trace (#25).

What it models (deterministic given --seed [0]; token counts are trace tokens, which
benchmarks.trace divides by its --scale [32]; defaults in brackets):
  * One long system prompt with tool schemas, shared by every agent: --system-tokens [15000]
    (Claude-Code-sized).
  * --agents [24] top-level agents arriving as a Poisson process (mean gap --arrival-s [4] s).
    Each opens with its own task (log-normal, median --task-tokens [1000], at least 600, so its
    first prompt always has a full block of its own past the system prompt), then runs a tool
    loop of --turns [6] requests (+-50%, seeded; it ends early once its context passes
    --max-context [100000]): each request's output is a short tool call (log-normal, median
    --output-tokens [40], 10..400); the tool's result (log-normal, median --result-tokens
    [1500], sigma 1.2, 50..20,000: a file read, a test log) and the call are appended, and the
    next request re-sends the whole context after the tool pause.
  * Tool pauses, heavy-tailed: log-normal, median --pause-s [2] s, sigma 1.2, 0.1..120 s; each
    request's timestamp also counts its own service time at --service-ms-per-token [25] ms per
    output token, so turn n+1 never arrives before turn n could have finished.
  * Sub-agents: after a request, with probability --fork-prob [0.2] (at most --max-forks [2]
    times an agent, top-level agents only), 1-3 sub-agents fork from the parent's context: each
    prompt is the parent's whole context + its own sub-task (~300 tokens), and runs a tool loop
    of 2-4 requests; the parent's next request waits for the last of them and appends their
    reports (~200 tokens each) as its tool result.
Hash ids: the context is a list of segments (system prompt, task, calls, results, reports, each
with its own id); a 512-token block's hash id is determined by its parent block's id and the
segment pieces it covers, so equal prefixes give equal ids and benchmarks.trace rebuilds the
sessions (sub-agents continue their parent's request).

    python -m benchmarks.agent_trace --out out/agent_trace.jsonl
    python -m benchmarks.trace --trace out/agent_trace.jsonl --scale 16 --time-scale 0.5 \
        --sessions 999 --min-turns 1 --max-turns 99

At --scale 16 the defaults make 300 requests in 24 sessions with 25 sub-agent forks, 434k prompt
tokens of which 89% are reusable, a working set of 47k replay tokens (twice a 1 GiB pool of
23,296: the issue's memory pressure), prompts of at most 4.1k tokens (the default model's
context is 8,192) and 13.8k output tokens; at --time-scale 0.5 the closed loop's floor is 76 s.
"""

from __future__ import annotations

import argparse
import json
import math
import random
import sys
from dataclasses import asdict, dataclass, field
from pathlib import Path

from benchmarks.trace_workload import TRACE_BLOCK

SUBTASK_TOKENS, REPORT_TOKENS = 300, 200
MIN_TASK_TOKENS = 600  # > one block: a first prompt never ends on the system prompt's blocks


@dataclass(frozen=True, slots=True)
class AgentTraceConfig:
    agents: int = 24
    turns: int = 6
    system_tokens: int = 15_000
    task_tokens: int = 1_000
    output_tokens: int = 40
    result_tokens: int = 1_500
    max_context: int = 100_000
    pause_s: float = 2.0
    arrival_s: float = 4.0
    service_ms_per_token: float = 25.0
    fork_prob: float = 0.2
    max_forks: int = 2
    seed: int = 0

    def __post_init__(self) -> None:
        for name in ("agents", "turns", "system_tokens", "task_tokens", "output_tokens",
                     "result_tokens", "max_context"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if not 0 <= self.fork_prob <= 1 or self.max_forks < 0:
            raise ValueError("fork_prob must be in [0, 1] and max_forks >= 0")


def lognormal(rng: random.Random, median: float, sigma: float, low: float, high: float) -> float:
    return min(max(rng.lognormvariate(math.log(median), sigma), low), high)


@dataclass(slots=True)
class BlockIds:
    """Hash ids of 512-token blocks: one id per (parent block id, segment pieces covered)."""

    ids: dict[tuple, int] = field(default_factory=dict)

    def of(self, segments: list[tuple[int, int]]) -> list[int]:
        """The hash ids of a prompt made of ``(segment id, length)`` pieces."""
        out: list[int] = []
        pieces: list[tuple[int, int, int]] = []  # (segment, start, end) in the current block
        room = TRACE_BLOCK
        for segment, length in segments:
            start = 0
            while start < length:
                take = min(room, length - start)
                pieces.append((segment, start, start + take))
                start, room = start + take, room - take
                if room == 0:
                    out.append(self._id(out, pieces))
                    pieces, room = [], TRACE_BLOCK
        if pieces:
            out.append(self._id(out, pieces))
        return out

    def _id(self, done: list[int], pieces: list[tuple[int, int, int]]) -> int:
        key = (done[-1] if done else -1, tuple(pieces))
        return self.ids.setdefault(key, len(self.ids))


@dataclass(slots=True)
class Generator:
    """Builds the requests (dicts of the trace format) of every agent."""

    config: AgentTraceConfig
    rng: random.Random
    blocks: BlockIds = field(default_factory=BlockIds)
    rows: list[dict] = field(default_factory=list)
    next_segment: int = 1  # 0 is the system prompt

    def segment(self, length: int) -> tuple[int, int]:
        self.next_segment += 1
        return (self.next_segment - 1, max(1, round(length)))

    def request(self, context: list[tuple[int, int]], at_ms: float) -> tuple[int, float]:
        """Emit one request; returns (its output length, when it finishes, ms)."""
        output = round(lognormal(self.rng, self.config.output_tokens, 0.6, 10, 400))
        self.rows.append({"timestamp": round(at_ms),
                          "input_length": sum(length for _, length in context),
                          "output_length": output, "hash_ids": self.blocks.of(context)})
        return output, at_ms + output * self.config.service_ms_per_token

    def pause_ms(self) -> float:
        return lognormal(self.rng, self.config.pause_s, 1.2, 0.1, 120.0) * 1000

    def tool_loop(self, context: list[tuple[int, int]], at_ms: float, turns: int,
                  forks_left: int) -> tuple[list[tuple[int, int]], float]:
        """Run ``turns`` requests from ``context``; returns (final context, end time ms)."""
        config = self.config
        for turn in range(turns):
            output, done_ms = self.request(context, at_ms)
            context = [*context, self.segment(output)]
            if turn == turns - 1 or sum(length for _, length in context) > config.max_context:
                return context, done_ms
            if forks_left and self.rng.random() < config.fork_prob:
                forks_left -= 1
                ends = [self.tool_loop([*context, self.segment(SUBTASK_TOKENS)],
                                       done_ms + self.pause_ms() / 10, self.rng.randint(2, 4), 0)[1]
                        for _ in range(self.rng.randint(1, 3))]
                result = self.segment(REPORT_TOKENS * len(ends))
                at_ms = max(ends) + self.pause_ms() / 10
            else:
                result = self.segment(lognormal(self.rng, config.result_tokens, 1.2, 50, 20_000))
                at_ms = done_ms + self.pause_ms()
            context = [*context, result]
        return context, at_ms


def generate(config: AgentTraceConfig) -> list[dict]:
    """Every request of the trace, in timestamp order (the format of ../shared/traces/)."""
    generator = Generator(config, random.Random(config.seed))
    rng = generator.rng
    system = (0, config.system_tokens)
    start_ms = 0.0
    for _ in range(config.agents):
        task = generator.segment(max(MIN_TASK_TOKENS, lognormal(rng, config.task_tokens, 0.5,
                                                                 MIN_TASK_TOKENS, 8_000)))
        turns = max(1, round(config.turns * rng.uniform(0.5, 1.5)))
        generator.tool_loop([system, task], start_ms, turns, config.max_forks)
        start_ms += rng.expovariate(1 / (config.arrival_s * 1000))
    return sorted(generator.rows, key=lambda row: row["timestamp"])


def write_trace(rows: list[dict], path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True, help="the JSONL file to write")
    defaults = asdict(AgentTraceConfig())
    for name, value in defaults.items():
        parser.add_argument("--" + name.replace("_", "-"), type=type(value), default=value)
    args = parser.parse_args(argv)
    try:
        config = AgentTraceConfig(**{name: getattr(args, name) for name in defaults})
    except ValueError as exc:
        parser.error(str(exc))
    rows = generate(config)
    write_trace(rows, args.out)
    print(f"wrote {len(rows)} requests of {config.agents} agents to {args.out} "
          f"({sum(r['input_length'] for r in rows)} prompt tokens, last at "
          f"{rows[-1]['timestamp'] / 1000:.0f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
