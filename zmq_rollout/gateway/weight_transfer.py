"""vLLM's weight-update endpoints (what TRL's ``VLLMClient`` calls), mapped onto a broker
sync round."""

from __future__ import annotations

from fastapi import FastAPI

from zmq_rollout.gateway.routes import Answer, GatewayState


def add_routes(app: FastAPI, gateway: GatewayState, answer: Answer) -> None:
    """Register this module's endpoints on ``app``."""
