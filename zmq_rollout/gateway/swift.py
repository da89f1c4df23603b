"""ms-swift's rollout server contract (``swift rollout``, ms-swift 4.6.0): ``/health/``,
``/infer/`` and the rest of what its ``VLLMClient`` calls, served on the gateway.

Sampling is served (``swift_protocol`` translates, pure). ms-swift's weight sync is not: its
trainer joins an NCCL group with the server's vLLM ranks (``/init_communicator/``) and
broadcasts tensors into it; the gateway has no ranks. Those endpoints answer 501 with a message
that points at ``update_weights`` (docs/integrations.md, "ms-swift"). The cache resets answer
200: workers drop their prefix caches at every weight update themselves, and the gateway holds
no multimodal cache.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from functools import partial
from typing import Any

import msgspec
from fastapi import FastAPI, Request
from fastapi.responses import Response

from zmq_rollout import errors
from zmq_rollout.client import AsyncRolloutClient
from zmq_rollout.gateway.openai_protocol import OpenAIError
from zmq_rollout.gateway.routes import Answer, GatewayState, unless_gone
from zmq_rollout.gateway.swift_protocol import ENGINE_TYPE, infer_response, parse_infer

_json = msgspec.json.Encoder()

WEIGHT_SYNC = (
    ("GET", "/get_model_state_keys/"),
    ("POST", "/init_communicator/"),
    ("POST", "/update_named_param/"),
    ("POST", "/update_flattened_params/"),
    ("POST", "/update_adapter_param/"),
    ("POST", "/update_adapter_flattened_param/"),
    ("POST", "/process_weights_after_loading/"),
)
"""ms-swift's weight-sync endpoints: answered 501 (``not_served``)."""

NOTHING_TO_RESET = {
    "/reset_prefix_cache/": "workers drop their prefix caches at every weight update (zmq_rollout's update_weights)",
    "/reset_encoder_cache/": "the gateway serves text only: no encoder cache holds anything",
    "/reset_mm_cache/": "the gateway serves text only: no multimodal cache holds anything",
    "/close_communicator/": "the gateway never opens a communicator",
}


def _ok(value: Any) -> Response:
    return Response(_json.encode(value), media_type="application/json")


def not_served(path: str) -> Response:
    """The answer to one of ms-swift's weight-sync endpoints: 501, in vLLM's error shape."""
    error = OpenAIError(
        f"{path} is ms-swift's NCCL weight sync, which the zmq-rollout gateway does not serve (it has no "
        "vLLM ranks to join a group): push weights to the workers with zmq_rollout's update_weights, a "
        "broker sync round (docs/integrations.md, section ms-swift; docs/weight_sync.md)",
        status=501,
    )
    return Response(_json.encode(error.body()), error.status, media_type="application/json")


def _client(gateway: GatewayState) -> AsyncRolloutClient:
    if gateway.client is None:
        raise errors.BrokerUnavailableError("the gateway has not connected to the broker yet")
    return gateway.client


async def infer(gateway: GatewayState, request: Request) -> Response:
    jobs = parse_infer(await request.body(), gateway.config.chat_max_tokens)
    if not jobs.prompts:
        return _ok([])
    model = await gateway.model_name(None)
    run = _client(gateway).generate(jobs.prompts, jobs.sampling, timeout_s=gateway.config.timeout_s)
    return _ok(infer_response(await unless_gone(request, run), model, jobs))


async def world_size(gateway: GatewayState) -> Response:
    """The engines the broker lists (tensor-parallel ranks are not known to it)."""
    try:
        status = await _client(gateway).status()
    except errors.RolloutTimeoutError as exc:
        raise errors.BrokerUnavailableError(str(exc)) from None
    return _ok({"world_size": len(status.workers)})


async def health(gateway: GatewayState) -> Response:
    await gateway.models()  # the broker answers STATUS: it is there
    return _ok({"status": "ok"})


async def engine_type() -> Response:
    return _ok({"engine_type": ENGINE_TYPE, "enable_multi_turn": False, "use_gym_env": False, "enable_lora": False})


async def _done(value: Response) -> Response:
    return value


def _fixed(answer: Answer, path: str, response: Callable[[], Response]) -> Callable[[Request], Awaitable[Response]]:
    """An endpoint whose answer does not depend on the request."""

    async def route(request: Request) -> Response:
        return await answer(path, request, _done(response()))

    return route


def add_routes(app: FastAPI, gateway: GatewayState, answer: Answer) -> None:
    """Register ms-swift's endpoints on ``app``, with the methods its server registers."""

    @app.get("/health/")
    async def health_route(request: Request) -> Response:
        return await answer("/health/", request, health(gateway))

    @app.post("/infer/")
    async def infer_route(request: Request) -> Response:
        return await answer("/infer/", request, infer(gateway, request))

    @app.get("/get_world_size/")
    async def world_size_route(request: Request) -> Response:
        return await answer("/get_world_size/", request, world_size(gateway))

    @app.post("/get_engine_type/")
    async def engine_type_route(request: Request) -> Response:
        return await answer("/get_engine_type/", request, engine_type())

    for path, why in NOTHING_TO_RESET.items():
        body = {"message": f"Request received, nothing to do: {why}"}
        app.add_api_route(path, _fixed(answer, path, partial(_ok, body)), methods=["POST"])
    for method, path in WEIGHT_SYNC:
        app.add_api_route(path, _fixed(answer, path, partial(not_served, path)), methods=[method])
