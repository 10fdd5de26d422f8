"""The swarm model: groups of agents sharing a system prompt, each running a multi-turn task.

A *group* shares one system prompt (role instructions + JSON tool schemas + policies). Each
*agent* has its own task and runs ``turns`` requests; after every turn it appends the assistant's
real reply and then a tool result or a user follow-up, so every turn re-sends a longer prefix of
the same conversation. Everything except the server's replies is deterministic from the seed.
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import Literal

from prefixgate.agents import texts

Arrival = Literal["burst", "staggered", "poisson"]
ARRIVALS: tuple[str, ...] = ("burst", "staggered", "poisson")


@dataclass(frozen=True, slots=True)
class SwarmConfig:
    """Every knob of a swarm workload (token counts are approximate, see ``texts``)."""

    groups: int = 4
    agents_per_group: int = 4
    turns: int = 4
    system_tokens: int = 1024  # shared per group, tool schemas included
    task_tokens: int = 128  # each agent's opening message
    followup_tokens: int = 64  # each tool result / user follow-up
    max_tokens: int = 32  # output tokens per request
    temperature: float = 0.0
    concurrency: int = 16  # requests in flight at most
    arrival: Arrival = "burst"
    interval_s: float = 0.5  # staggered: agent k starts at k * interval_s
    rate: float = 4.0  # poisson: agents arriving per second
    seed: int = 0
    model: str | None = None  # None: the server's first model from GET /v1/models
    tools_field: bool = False  # send schemas in the `tools` field instead of the system text

    def __post_init__(self) -> None:
        for name in ("groups", "agents_per_group", "turns", "system_tokens", "task_tokens",
                     "followup_tokens", "max_tokens", "concurrency"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.arrival not in ARRIVALS:
            raise ValueError(f"arrival must be one of {ARRIVALS}, got {self.arrival!r}")
        if self.interval_s < 0:
            raise ValueError(f"interval_s must be >= 0, got {self.interval_s}")
        if self.rate <= 0:
            raise ValueError(f"rate must be > 0, got {self.rate}")
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")

    def to_dict(self) -> dict:
        return asdict(self)


@dataclass(frozen=True, slots=True)
class Agent:
    """One agent: its group's shared prefix, its own task, and the follow-ups of turns 2..T."""

    agent_id: str
    group: int
    start_s: float  # arrival time after the run starts
    system: str
    tools: tuple[dict, ...]  # non-empty only when the schemas travel in the `tools` field
    task: str
    followups: tuple[str, ...]  # turns - 1 user messages (tool results or follow-ups)

    @property
    def turns(self) -> int:
        return len(self.followups) + 1

    def messages(self, replies: Sequence[str]) -> list[dict]:
        """Chat history for turn ``len(replies)`` given the assistant replies received so far."""
        if len(replies) >= self.turns:
            raise ValueError(f"agent {self.agent_id} has {self.turns} turns, got "
                             f"{len(replies)} replies")
        history = [{"role": "system", "content": self.system},
                   {"role": "user", "content": self.task}]
        for reply, followup in zip(replies, self.followups, strict=False):
            history.append({"role": "assistant", "content": reply})
            history.append({"role": "user", "content": followup})
        return history


@dataclass(frozen=True, slots=True)
class Workload:
    """The agents of a swarm, in arrival order."""

    config: SwarmConfig
    agents: tuple[Agent, ...]

    @property
    def num_requests(self) -> int:
        return sum(agent.turns for agent in self.agents)


def _arrivals(config: SwarmConfig, count: int) -> list[float]:
    if config.arrival == "burst":
        return [0.0] * count
    if config.arrival == "staggered":
        return [k * config.interval_s for k in range(count)]
    rng = random.Random(f"{config.seed}/arrivals")
    times, now = [], 0.0
    for _ in range(count):
        times.append(now)
        now += rng.expovariate(config.rate)
    return times


def build_workload(config: SwarmConfig) -> Workload:
    """Generate the swarm for ``config``; the same config always yields the same workload."""
    systems = []
    for group in range(config.groups):
        rng = random.Random(f"{config.seed}/group{group}")
        instructions, tools, policies = texts.system_prompt(rng, config.system_tokens)
        embedded = [] if config.tools_field else tools
        field_tools = tuple(tools) if config.tools_field else ()
        systems.append((texts.render_system(instructions, embedded, policies), field_tools, tools))
    # Round-robin over groups so every group's prefix is in play from the first second.
    order = [(group, index) for index in range(config.agents_per_group)
             for group in range(config.groups)]
    agents = []
    for (group, index), start_s in zip(order, _arrivals(config, len(order)), strict=True):
        system, field_tools, tools = systems[group]
        rng = random.Random(f"{config.seed}/group{group}/agent{index}")
        task = texts.task(rng, config.task_tokens)
        followups = []
        for _ in range(config.turns - 1):
            if tools and rng.random() < 0.5:
                name = rng.choice(tools)["function"]["name"]
                followups.append(texts.tool_result(rng, name, config.followup_tokens))
            else:
                followups.append(texts.followup(rng, config.followup_tokens))
        agents.append(Agent(agent_id=f"g{group}-a{index}", group=group, start_s=start_s,
                            system=system, tools=field_tools, task=task,
                            followups=tuple(followups)))
    return Workload(config=config, agents=tuple(agents))
