"""What a module of extra endpoints gets from the app (``add_routes(app, gateway, answer)``),
typed without importing the app (which imports those modules)."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Protocol

from fastapi import Request
from fastapi.responses import Response

from zmq_rollout.client import AsyncRolloutClient
from zmq_rollout.gateway.config import GatewayConfig

Answer = Callable[[str, Request, Awaitable[Response]], Awaitable[Response]]
"""``answer(endpoint, request, work)``: awaits ``work``, translates its errors (``app.error_of``)
into vLLM-shaped responses, and counts the request in the gateway's metrics."""


class GatewayState(Protocol):
    """The gateway's state, as an endpoint module sees it (``app.Gateway``)."""

    config: GatewayConfig
    client: AsyncRolloutClient | None

    async def models(self, fresh: bool = False) -> dict[str, int]:
        """Model name -> its longest max_model_len, from the broker's status."""
        ...

    async def model_name(self, asked: str | None) -> str:
        """The name a response carries; an unknown model is a 404."""
        ...
