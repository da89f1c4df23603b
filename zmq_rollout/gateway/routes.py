"""What a module of extra endpoints gets from the app (``add_routes(app, gateway, answer)``),
typed without importing the app (which imports those modules)."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Protocol, TypeVar

from fastapi import Request
from fastapi.responses import Response
from starlette.types import Receive

from zmq_rollout.client import AsyncRolloutClient
from zmq_rollout.gateway.config import GatewayConfig

T = TypeVar("T")

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


class ClientGone(Exception):
    """The HTTP client went away before its answer (``answer`` counts it as 499)."""


async def disconnected(receive: Receive) -> None:
    """Returns when the ASGI server says the HTTP client disconnected."""
    while (await receive())["type"] != "http.disconnect":
        pass


async def unless_gone(request: Request, work: Awaitable[T]) -> T:
    """``await work``, cancelled (and its jobs with it) if the HTTP client goes away first:
    then ``ClientGone``. A trainer that dies leaves no batch of rollouts running."""
    task = asyncio.ensure_future(work)
    gone = asyncio.ensure_future(disconnected(request.receive))
    try:
        await asyncio.wait({task, gone}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        gone.cancel()
        if not task.done():
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
    if task.cancelled():
        raise ClientGone
    return task.result()
