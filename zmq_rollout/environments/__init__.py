"""Environments for multi-turn rollouts: the plugin API, the registry, three examples.

See docs/multi_turn.md and ``zmq_rollout.episodes.run_episodes``.
"""

from .base import (
    Action,
    Environment,
    Message,
    MultiTurnScheduler,
    Observation,
    SchedulerEnvironment,
    StepResult,
    ToolCall,
    parse_tool_calls,
)
from .registry import GROUP, available, build, factory, register

__all__ = [
    "GROUP",
    "Action",
    "Environment",
    "Message",
    "MultiTurnScheduler",
    "Observation",
    "SchedulerEnvironment",
    "StepResult",
    "ToolCall",
    "available",
    "build",
    "factory",
    "parse_tool_calls",
    "register",
]
