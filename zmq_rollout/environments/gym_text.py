"""Any ``gymnasium`` environment with a discrete action space, as a text environment.

The observation is written into a user message (``render``, by default ``str(obs)`` with
the valid actions), the assistant's turn is parsed into an action (``parse``, by default the
last integer in the text), and gymnasium's reward and ``terminated or truncated`` become the
turn's reward and ``done``. A turn that names no valid action gets ``invalid_reward`` and
the same observation again, so a garbage turn costs the model a turn, not the episode.

    run_episodes("gymnasium", samples=[{"seed": 0}] * 8, env_kwargs={"env_id": "FrozenLake-v1"}, ...)
"""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import Any

from .base import Action, Environment, Observation, StepResult

_INT = re.compile(r"-?\d+")


def last_int(text: str, n: int) -> int | None:
    found = _INT.findall(text)
    if not found:
        return None
    value = int(found[-1])
    return value if 0 <= value < n else None


class GymTextEnvironment(Environment):
    def __init__(
        self,
        env_id: str | None = None,
        env: Any = None,
        make_kwargs: dict[str, Any] | None = None,
        render: Callable[[Any], str] | None = None,
        parse: Callable[[str, int], int | None] = last_int,
        invalid_reward: float = 0.0,
    ) -> None:
        import gymnasium

        if (env_id is None) == (env is None):
            raise ValueError("give exactly one of env_id (a gymnasium id) and env (an environment)")
        self.env = env if env is not None else gymnasium.make(str(env_id), **(make_kwargs or {}))
        space = self.env.action_space
        if not isinstance(space, gymnasium.spaces.Discrete):
            raise ValueError(f"GymTextEnvironment needs a Discrete action space, not {type(space).__name__}")
        self.n = int(space.n)
        self.render = render or (lambda obs: f"Observation: {obs}. Reply with an action from 0 to {self.n - 1}.")
        self.parse, self.invalid_reward = parse, invalid_reward
        self.last: Any = None

    async def reset(self, sample: Any) -> Observation:
        seed = sample.get("seed") if isinstance(sample, dict) else None
        self.last, _ = self.env.reset(seed=seed)
        return Observation.of(self.render(self.last))

    async def step(self, action: Action) -> StepResult:
        choice = self.parse(action.text, self.n)
        if choice is None:
            note = f"That is not an action. Reply with an action from 0 to {self.n - 1}. "
            return StepResult(
                Observation.of(note + self.render(self.last)), self.invalid_reward, False, {"invalid": True}
            )
        self.last, reward, terminated, truncated, info = self.env.step(choice)
        done = bool(terminated or truncated)
        return StepResult(None if done else Observation.of(self.render(self.last)), float(reward), done, dict(info))

    async def close(self) -> None:
        self.env.close()
