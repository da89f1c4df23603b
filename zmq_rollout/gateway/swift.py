"""ms-swift's rollout server contract (`swift rollout`): `/health/`, `/infer/` and the
rest of what its `VLLMClient` calls, served on the gateway."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING

from fastapi import FastAPI, Request
from fastapi.responses import Response

if TYPE_CHECKING:
    from zmq_rollout.gateway.app import Gateway

Answer = Callable[[str, Request, Awaitable[Response]], Awaitable[Response]]


def add_routes(app: FastAPI, gateway: Gateway, answer: Answer) -> None:
    """Register this module's endpoints on ``app``."""
