"""The plugin API of multi-turn rollouts: what an environment sees and says.

Two shapes, both registered by name (``zmq_rollout.environments.registry``):

- ``Environment``, gym-style: ``await reset(sample)`` gives the first ``Observation`` (the
  prompt's messages), and ``await step(action)`` answers each assistant turn with a
  ``StepResult`` (the next messages, a reward, whether the episode is done, info).
- ``MultiTurnScheduler``, the simpler case (ms-swift's shape): it only says what the next
  user or tool message is, and when to stop; ``SchedulerEnvironment`` makes it an
  ``Environment`` with reward 0 per turn (score the trajectory afterwards).

One instance serves one episode: the runner builds a new one per episode from its factory.
"""

from __future__ import annotations

import json
import re
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Any

Message = dict[str, Any]


@dataclass
class ToolCall:
    """A tool call parsed from an assistant turn (``<tool_call>{"name": ..., "arguments": ...}</tool_call>``,
    the Hermes/Qwen format)."""

    name: str
    arguments: dict[str, Any]


@dataclass
class Action:
    """One assistant turn, as the model produced it."""

    text: str  # vLLM's detokenized text (stop strings cut as vLLM cuts them)
    token_ids: list[int]  # the ids the model sampled: the source of truth
    finish_reason: str  # "stop" (end of message or a stop string) or "length"
    tool_calls: list[ToolCall] = field(default_factory=list)
    turn: int = 0  # 0 for the first assistant turn


@dataclass
class Observation:
    """Messages to add to the conversation (role and content, as a chat template takes them)."""

    messages: list[Message]

    @classmethod
    def of(cls, value: Observation | str | list[Message] | Message) -> Observation:
        """An ``Observation`` from a string (one user message), a message, or a list of messages."""
        if isinstance(value, Observation):
            return value
        if isinstance(value, str):
            return cls([{"role": "user", "content": value}])
        if isinstance(value, dict):
            return cls([value])
        if isinstance(value, list) and all(isinstance(m, dict) and "role" in m for m in value):
            return cls(list(value))
        raise TypeError(
            f"an observation is a string, a message dict with a role, or a list of them; got {type(value).__name__}"
        )


@dataclass
class StepResult:
    """What an environment answers to an assistant turn."""

    observation: Observation | None = None  # the next messages; None (or done) ends the episode
    reward: float = 0.0
    done: bool = False
    info: dict[str, Any] = field(default_factory=dict)


class Environment(ABC):
    """A gym-style environment for one episode."""

    @abstractmethod
    async def reset(self, sample: Any) -> Observation:
        """The episode's first messages, from one input sample (whatever the caller passes)."""

    @abstractmethod
    async def step(self, action: Action) -> StepResult:
        """Answer one assistant turn."""

    async def close(self) -> None:  # noqa: B027 (optional hook)
        """Release what the episode holds; called once, whatever the episode's end."""


class MultiTurnScheduler(ABC):
    """The next user or tool message after each assistant turn, and when to stop."""

    def first(self, sample: Any) -> Observation | str | list[Message]:
        """The first messages. By default: ``sample`` itself (a string or messages), or its
        ``messages`` / ``prompt`` key if it is a dict."""
        if isinstance(sample, dict) and "messages" in sample:
            return list(sample["messages"])
        if isinstance(sample, dict) and "prompt" in sample:
            return str(sample["prompt"])
        return sample

    @abstractmethod
    def next_message(
        self, history: list[Message], action: Action, sample: Any
    ) -> Observation | str | list[Message] | None:
        """What to send next, or None to end the episode."""


class SchedulerEnvironment(Environment):
    """A ``MultiTurnScheduler`` as an ``Environment`` (reward 0 per turn)."""

    def __init__(self, scheduler: MultiTurnScheduler) -> None:
        self.scheduler = scheduler
        self.history: list[Message] = []
        self.sample: Any = None

    async def reset(self, sample: Any) -> Observation:
        self.sample = sample
        first = Observation.of(self.scheduler.first(sample))
        self.history = list(first.messages)
        return first

    async def step(self, action: Action) -> StepResult:
        self.history.append({"role": "assistant", "content": action.text})
        nxt = self.scheduler.next_message(self.history, action, self.sample)
        if nxt is None:
            return StepResult(None, 0.0, True)
        observation = Observation.of(nxt)
        self.history.extend(observation.messages)
        return StepResult(observation, 0.0, False)


_TOOL_CALL = re.compile(r"<tool_call>\s*(\{.*?\})\s*</tool_call>", re.DOTALL)


def parse_tool_calls(text: str) -> list[ToolCall]:
    """Tool calls in the Hermes/Qwen format; malformed ones are skipped (the environment sees
    the text and may answer it)."""
    calls = []
    for match in _TOOL_CALL.finditer(text):
        try:
            body = json.loads(match.group(1))
        except ValueError:
            continue
        if isinstance(body, dict) and isinstance(body.get("name"), str):
            args = body.get("arguments", {})
            calls.append(ToolCall(body["name"], args if isinstance(args, dict) else {"value": args}))
    return calls
