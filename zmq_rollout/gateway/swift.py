"""ms-swift's rollout server contract (`swift rollout`): `/health/`, `/infer/` and the
rest of what its `VLLMClient` calls, served on the gateway."""

from __future__ import annotations

from fastapi import FastAPI

from zmq_rollout.gateway.routes import Answer, GatewayState


def add_routes(app: FastAPI, gateway: GatewayState, answer: Answer) -> None:
    """Register this module's endpoints on ``app``."""
