"""A scripted multi-step environment: for tests and for ``examples/grpo_multiturn.py``.

Each turn the user asks for ``target`` again; the turn's reward is the fraction of the
assistant's tokens equal to ``target``'s byte (the tiny test model's tokenizer is
byte-level: token id == byte value), which a policy can learn in a few steps. The episode
ends after ``turns`` assistant turns. ``raise_at``, ``hang_at``, ``block_at`` and ``die_at``
make turn *k*'s step raise, hang (in ``await``), block its process (``time.sleep``), or kill
its process, for the failure tests; a sample dict may set them for its own episodes
(``{"prompt": ..., "raise_at": 2}``).
"""

from __future__ import annotations

import asyncio
import os
import signal
import time
from typing import Any

from .base import Action, Environment, Observation, StepResult


class ScriptedEnvironment(Environment):
    def __init__(
        self,
        turns: int = 3,
        target: str = "a",
        raise_at: int | None = None,
        hang_at: int | None = None,
        die_at: int | None = None,
        block_at: int | None = None,
    ) -> None:
        if turns < 1:
            raise ValueError("turns must be at least 1")
        if len(target.encode()) != 1:
            raise ValueError("target is one ASCII character")
        self.turns, self.target = turns, target.encode()[0]
        self.raise_at, self.hang_at, self.die_at, self.block_at = raise_at, hang_at, die_at, block_at
        self.turn = 0
        self.prefix = ""

    async def reset(self, sample: Any) -> Observation:
        self.turn = 0
        self.prefix = ""
        if isinstance(sample, str):
            self.prefix = sample
        elif isinstance(sample, dict):
            self.prefix = str(sample.get("prompt", ""))
            for name in ("raise_at", "hang_at", "die_at", "block_at"):
                if name in sample:
                    setattr(self, name, sample[name])
        return Observation.of(f"{self.prefix}Turn 1 of {self.turns}: say {chr(self.target)}.")

    async def step(self, action: Action) -> StepResult:
        self.turn += 1
        if self.turn == self.raise_at:
            raise RuntimeError(f"scripted failure at turn {self.turn}")
        if self.turn == self.hang_at:
            await asyncio.Event().wait()  # never set: hangs until the runner's timeout cancels it
        if self.turn == self.block_at:
            time.sleep(3600)  # blocks the process's event loop: only a kill ends it
        if self.turn == self.die_at:
            os.kill(os.getpid(), signal.SIGKILL)
        hits = sum(t == self.target for t in action.token_ids)
        reward = hits / max(1, len(action.token_ids))
        if self.turn >= self.turns:
            return StepResult(None, reward, True, {"turns": self.turn})
        ask = f"Turn {self.turn + 1} of {self.turns}: say {chr(self.target)}."
        return StepResult(Observation.of(ask), reward, False)
