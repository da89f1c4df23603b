"""vLLM's weight-update endpoints (what TRL's ``VLLMClient`` calls), mapped onto a broker sync round.

A vLLM server (0.32, ``VLLM_SERVER_DEV_MODE=1 vllm serve --weight-transfer-config ...``) takes
new weights in four calls, the trainer being rank 0 of a group with the server's workers:
``/init_weight_transfer_engine`` once, then per update ``/start_weight_update``,
``/update_weights`` (while the trainer broadcasts the tensors it names) and
``/finish_weight_update``. The gateway maps them onto one broker sync round (``update_weights``
of the Python client: begin (pause) → data steps → commit, a new fleet version), so the same
calls update every worker of the fleet:

==============================================  =================================================================
vLLM endpoint                                   here
==============================================  =================================================================
``GET /get_world_size``                         the fleet's ranks: every worker's tensor-parallel size, summed
                                                (``include_dp=false``: one engine's)
``GET /server_info``                            ``vllm_config``: the model, and ``weight_transfer_config``
                                                (``{"backend": "gloo"}``) only if the gateway was started with
                                                ``--weight-transfer-backend gloo`` and has workers; else ``null``
                                                (TRL's ``init_communicator`` then stops at once)
``POST /init_weight_transfer_engine``           checks and keeps ``init_info`` (``rank_offset`` 1, ``world_size`` =
                                                world size + 1, ``packed``...); no round, no pause
``POST /start_weight_update``                   ``begin`` (pause ``wait``; nothing if ``/pause`` opened the round);
                                                409 if the fleet's ranks no longer make ``world_size``
``POST /update_weights``                        the round's first: [``check_names`` if ``init_info`` asked for it
                                                (names a checkpoint lacks: 400 and abort, nothing loaded)],
                                                ``join_group`` (every worker rank joins the trainer's group at
                                                ``master_address:master_port``), ``begin_update``; then one
                                                ``receive_bucket`` per broadcast, in vLLM's packed layout
                                                (``weight_bodies.chunks``)
``POST /finish_weight_update``                  ``leave_group``, ``finish_update``, ``commit``: version
                                                ``weight_version`` (an integer) or the fleet's + 1; answered with
                                                it, and the workers updated and evicted
``POST /pause?mode=abort|wait|keep``            ``begin`` in that mode, held until ``/resume`` or a weight update
``POST /resume``                                ``abort`` of a round ``/pause`` opened, or of an update that has
                                                loaded nothing yet (weights untouched); nothing after a finished
                                                update (``commit`` resumed); 409 once loading began
``POST /reset_prefix_cache``                    a round ends by clearing every worker's prefix cache (not in
                                                ``keep``): inside one, ``{"success": true}``; outside, a
                                                ``begin(abort)`` + ``abort`` round, or ``false`` while jobs run
                                                (as vLLM) unless ``reset_running_requests=true``
``POST /shutdown_weight_transfer_engine``       forgets ``init_info``
==============================================  =================================================================

**The group.** A vLLM worker joins the trainer's group once, at init. Ours join it per round,
at the round's first ``/update_weights`` (a worker that joined the fleet since init is then
in the group too), and leave it at ``/finish_weight_update``: the trainer opens its end of
the group (rank 0, hosting the rendezvous on ``master_port``) on its first broadcast of a
round and closes it after the last. The backend is **gloo**: our ``CollectiveGroup`` (a
``TCPStore`` + ``ProcessGroupGloo``) and the workers' existing receivers; the trainer's side
is ``zmq_rollout.integrations.vllm_weights.WeightTransferClient`` (TRL's weight methods over
gloo; it runs on CPU end to end). TRL's own ``VLLMClient`` speaks NCCL through vLLM's
``StatelessProcessGroup`` + ``PyNcclCommunicator`` and is not served yet: it needs a worker
step that joins that group at init (``WeightUpdates._join`` / ``_leave`` say where it goes;
the bodies, the layout and the round stay) and two GPUs to test it. Pointed at a gateway with
gloo on, it would wait in its NCCL rendezvous for workers that never come: keep it off there.

**Ending rounds.** A step that fails aborts the round (workers resume; those that had begun
loading restart from their checkpoint, as after any aborted round), so does a round left
without a call for ``--weight-transfer-timeout-s`` (its trainer is gone; the broker's own
``round_idle_timeout_s`` is the backstop), and every step and the group have that timeout.
A request whose HTTP client goes away still runs to its end (``asyncio.shield``), so a round
is never cut between two steps.

**Errors** (vLLM's ``ErrorResponse``): a body, name, dtype, shape or version refused: 400
naming the field; a call out of turn (update or finish without start): 400; another round
running, a fleet changed since init, resume while loading: 409; the broker gone: 503; a step that
failed on a worker: 500 (the round aborted).
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Awaitable, Callable
from typing import Any

import msgspec
from fastapi import FastAPI, Request
from fastapi.responses import Response

from zmq_rollout import errors
from zmq_rollout import protocol as p
from zmq_rollout.client import AsyncRolloutClient
from zmq_rollout.gateway.routes import Answer, GatewayState
from zmq_rollout.gateway.weight_bodies import BadBody
from zmq_rollout.gateway.weight_rounds import WeightUpdates, http_error

_json = msgspec.json.Encoder()
Call = Callable[[Request], Awaitable[dict[str, Any]]]


class _Broker:
    """The gateway's client, looked up at each call (it connects at startup)."""

    def __init__(self, gateway: GatewayState) -> None:
        self.gateway = gateway

    def _client(self) -> AsyncRolloutClient:
        if self.gateway.client is None:
            raise errors.BrokerUnavailableError("the gateway is not connected to the broker yet")
        return self.gateway.client

    async def sync_step(self, step: p.SyncStep) -> p.SyncReply:
        return await self._client().sync_step(step)

    async def status(self) -> p.StatusReply:
        return await self._client().status()


async def _body(request: Request) -> Any:
    raw = await request.body()
    if not raw.strip():
        return {}
    try:
        return json.loads(raw)
    except ValueError:
        raise BadBody("the body is not JSON", "body") from None


def _flag(request: Request, name: str, default: bool) -> bool:
    value = request.query_params.get(name)
    if value is None:
        return default
    if value.lower() not in ("true", "false", "1", "0"):
        raise BadBody(f"{name} must be true or false, got {value!r}", name)
    return value.lower() in ("true", "1")


async def _answered(work: Awaitable[dict[str, Any]]) -> Response:
    """``work``'s result as JSON, its error as ours. Shielded: a client that goes away does not
    cut a round between two steps."""
    task = asyncio.ensure_future(work)
    try:
        result = await asyncio.shield(task)
    except Exception as exc:
        raise http_error(exc) from exc
    return Response(_json.encode(result), media_type="application/json")


def add_routes(app: FastAPI, gateway: GatewayState, answer: Answer) -> None:
    """Register vLLM's weight-update endpoints on ``app`` (their state: ``app.state.weight_updates``)."""
    broker = _Broker(gateway)
    updates = WeightUpdates(
        broker,
        broker.status,
        backend=gateway.config.weight_transfer_backend,
        timeout_s=gateway.config.weight_transfer_timeout_s,
    )
    app.state.weight_updates = updates

    def route(method: str, path: str, call: Call) -> None:
        async def endpoint(request: Request) -> Response:
            async def work() -> dict[str, Any]:
                return await call(request)

            return await answer(path, request, _answered(work()))

        app.add_api_route(path, endpoint, methods=[method], name=path.strip("/"))

    async def world_size(request: Request) -> dict[str, Any]:
        return {"world_size": await updates.world_size(_flag(request, "include_dp", True))}

    async def server_info(request: Request) -> dict[str, Any]:
        config = await updates.server_info()
        text = request.query_params.get("config_format", "text") == "text"
        return {"vllm_config": json.dumps(config) if text else config, "vllm_env": {}, "system_env": {}}

    async def init_engine(request: Request) -> dict[str, Any]:
        return await updates.init_engine(await _body(request))

    async def shutdown_engine(request: Request) -> dict[str, Any]:
        return await updates.shutdown_engine()

    async def start(request: Request) -> dict[str, Any]:
        return await updates.start()

    async def update(request: Request) -> dict[str, Any]:
        return await updates.update(await _body(request))

    async def finish(request: Request) -> dict[str, Any]:
        return await updates.finish(await _body(request))

    async def pause(request: Request) -> dict[str, Any]:
        return await updates.pause(request.query_params.get("mode", "abort"))

    async def resume(request: Request) -> dict[str, Any]:
        return await updates.resume()

    async def reset_prefix_cache(request: Request) -> dict[str, Any]:
        return await updates.reset_prefix_cache(running=_flag(request, "reset_running_requests", False))

    route("GET", "/get_world_size", world_size)
    route("GET", "/server_info", server_info)
    route("POST", "/init_weight_transfer_engine", init_engine)
    route("POST", "/shutdown_weight_transfer_engine", shutdown_engine)
    route("POST", "/start_weight_update", start)
    route("POST", "/update_weights", update)
    route("POST", "/finish_weight_update", finish)
    route("POST", "/pause", pause)
    route("POST", "/resume", resume)
    route("POST", "/reset_prefix_cache", reset_prefix_cache)
