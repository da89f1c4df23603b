"""The weight endpoints' state: one broker sync round, held across HTTP requests.

``WeightUpdates`` turns vLLM's weight-update calls into the steps of a round
(``weight_transfer``'s docstring has the table) and keeps what lies between them: what
``/init_weight_transfer_engine`` said, the round in progress and how far it got (paused,
group joined, loading begun). It needs two things of the broker: a ``StepSender`` and a
status call, so tests drive it with no socket. Calls run one at a time (a lock).

Every path ends the round or leaves it in a state the next call can finish: a step that
fails aborts it (workers resume, or restart from their checkpoint if loading had begun: the
broker's failure model), and so does a round left without a call for ``timeout_s``
(``expire``; a trainer that vanished). Errors leave through ``http_error``, the one place
they become statuses.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

from zmq_rollout import errors
from zmq_rollout import protocol as p
from zmq_rollout.gateway.openai_protocol import OpenAIError
from zmq_rollout.gateway.weight_bodies import GROUP_NAME, BadBody, InitInfo, UpdateInfo, chunks
from zmq_rollout.weight_sync import StepSender, SyncRound

log = logging.getLogger(__name__)

START_PAUSE = "wait"
"""How ``/start_weight_update`` pauses a fleet that ``/pause`` did not: jobs in flight finish
on the old weights (``/pause?mode=`` chooses another)."""
IDLE, PAUSED, UPDATING = "idle", "paused", "updating"


def http_error(exc: BaseException) -> BaseException:
    """The HTTP answer to an error of these endpoints (``OpenAIError``); anything else is left
    to the gateway's ``error_of``."""
    if isinstance(exc, BadBody):
        return OpenAIError(str(exc), param=exc.param)
    if isinstance(exc, errors.SyncError):
        text = str(exc)
        if " refused: " in text:  # the broker turned the step down: another round, or ours is over
            return OpenAIError(text, status=409)
        if text.startswith("the broker at "):  # lost or restarted: the client's words for it
            return OpenAIError(f"the broker is not available: {text}", status=503)
        return OpenAIError(
            f"{text}; the round was aborted (workers that had begun loading restart from their checkpoint)",
            status=500,
            err_type="InternalServerError",
        )
    return exc


def _version(value: Any) -> int | None:
    """vLLM's ``weight_version`` (a string there) as ours (an integer)."""
    if value is None:
        return None
    if type(value) is int or (isinstance(value, str) and value.isdigit()):
        return int(value)
    raise BadBody(f"weight_version must be an integer (zmq-rollout numbers versions), got {value!r}", "weight_version")


class WeightUpdates:
    """vLLM's weight-update protocol over one broker client. ``backend``: ``"gloo"``, or ``""``
    (off: ``server_info`` reports no weight-transfer engine, and ``init`` is refused)."""

    def __init__(
        self,
        sender: StepSender,
        status: Callable[[], Awaitable[p.StatusReply]],
        *,
        backend: str,
        timeout_s: float,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.sender, self._ask_status = sender, status
        self.backend, self.timeout_s, self.clock = backend, timeout_s, clock
        self.init: InitInfo | None = None
        self.round: SyncRound | None = None
        self.phase = IDLE
        self.pause_mode = START_PAUSE
        self.joined = False
        """The members are in the trainer's group (the round's first non-empty ``/update_weights``)."""
        self.began = False
        """``begin_update`` went out: from here an abort restarts the members."""
        self.version: int | None = None
        """The last version committed here."""
        self._lock = asyncio.Lock()
        self._busy = False
        self._last = clock()
        self._watch: asyncio.Task[None] | None = None

    # -- the fleet ------------------------------------------------------------------------
    async def status(self) -> p.StatusReply:
        try:
            return await self._ask_status()
        except errors.RolloutTimeoutError as exc:
            raise errors.BrokerUnavailableError(str(exc)) from None

    async def world_size(self, include_dp: bool = True) -> int:
        """The fleet's ranks (every engine's; ``include_dp=False``: one engine's, as vLLM)."""
        ranks = [w.num_ranks for w in (await self.status()).workers]
        return sum(ranks) if include_dp else max(ranks, default=0)

    async def server_info(self) -> dict[str, Any]:
        """The part of vLLM's ``vllm_config`` that clients read; ``weight_transfer_config`` only
        when updates can go through (a backend, and workers to take them)."""
        status = await self.status()
        model = status.workers[0].model if status.workers else None
        longest = max((w.max_model_len for w in status.workers), default=0)
        return {
            "model_config": {"model": model, "max_model_len": longest or None, "logprobs_mode": "processed_logprobs"},
            "parallel_config": {"data_parallel_size": len(status.workers)},
            "weight_transfer_config": {"backend": self.backend} if self.backend and status.workers else None,
            "weight_version": status.fleet_version,
        }

    # -- the protocol ---------------------------------------------------------------------
    async def init_engine(self, body: Any) -> dict[str, Any]:
        if not self.backend:
            raise OpenAIError("weight transfer is off on this gateway (zmq-rollout gateway --weight-transfer-backend "
                              "gloo turns it on)")  # fmt: skip
        info = InitInfo.parse(body, self.backend)
        async with self._call():
            if self.phase == UPDATING:
                raise OpenAIError("a weight update is in progress: finish it first", status=409)
            world = 1 + await self.world_size()
            if info.world_size != world:
                raise BadBody(
                    f"init_info.world_size is {info.world_size}, but the trainer and the fleet's {world - 1} "
                    f"ranks make {world} (/get_world_size + 1)",
                    "init_info.world_size",
                )
            self.init = info
        log.info("weight transfer: a %s trainer at %s:%d, %d ranks", info.backend, info.master_address,
                 info.master_port, info.world_size)  # fmt: skip
        return {"message": "Weight transfer initialized"}

    async def shutdown_engine(self) -> dict[str, Any]:
        async with self._call():
            if self.phase == UPDATING:
                raise OpenAIError("a weight update is in progress: finish it first", status=409)
            self.init = None
        return {"message": "Weight transfer shut down"}

    async def start(self) -> dict[str, Any]:
        async with self._call():
            init = self.init
            if init is None:
                raise OpenAIError("no weight transfer engine: call /init_weight_transfer_engine first")
            if self.phase == UPDATING:
                raise OpenAIError("a weight update is already in progress", status=409)
            opened = self.phase == IDLE
            if opened:
                await self._begin(START_PAUSE)
            assert self.round is not None
            world = self.round.num_ranks
            if world != init.world_size:
                if opened:
                    await self._abort()
                raise OpenAIError(
                    f"the fleet has changed since /init_weight_transfer_engine: the trainer and its "
                    f"{world - 1} ranks make {world}, init_info.world_size was {init.world_size}; call it again",
                    status=409,
                )
            self.phase, self.joined, self.began = UPDATING, False, False
        return {"message": "Weight update started"}

    async def update(self, body: Any) -> dict[str, Any]:
        update = UpdateInfo.parse(body)
        async with self._call():
            if self.phase != UPDATING:
                raise OpenAIError("no weight update in progress: call /start_weight_update first")
            rnd, init = self.round, self.init
            assert rnd is not None and init is not None
            buckets = chunks(update, init)  # a 400 here leaves the round as it was
            if not buckets:
                return {"message": "Weights updated"}
            try:
                if not self.began:
                    if init.check_names:
                        await self._check_names(rnd, update.names)
                    await self._join(rnd, init)
                    await rnd.step(p.BeginUpdate(True))
                    self.began = True
                for bucket in buckets:
                    await rnd.step(p.ReceiveBucket(bucket))
            except BaseException:
                await self._abort()
                raise
        return {"message": "Weights updated"}

    async def finish(self, body: Any) -> dict[str, Any]:
        asked = _version(body.get("weight_version") if isinstance(body, dict) else None)
        async with self._call():
            rnd = self.round
            if self.phase != UPDATING or rnd is None:
                raise OpenAIError("no weight update in progress: call /start_weight_update first")
            target = rnd.fleet_version + 1 if asked is None else asked
            if target <= rnd.fleet_version or target > p.MAX_VERSION:
                raise BadBody(f"weight_version must be above the fleet's {rnd.fleet_version} (and at most "
                              f"{p.MAX_VERSION}), got {target}", "weight_version")  # fmt: skip
            try:
                await self._leave(rnd)
                if self.began:
                    await rnd.step(p.FinishUpdate())
                await rnd.step(p.Commit(target))
            except BaseException:
                await self._abort()
                raise
            self._ended()
            self.version = target
        log.info("weight transfer: version %d on %s", target, ", ".join(rnd.members) or "no worker")
        return {
            "message": "Weight update finished",
            "weight_version": target,
            "workers_updated": list(rnd.members),
            "workers_evicted": [{"name": e.name, "reason": e.reason} for e in rnd.evicted],
        }

    async def pause(self, mode: str) -> dict[str, Any]:
        if mode not in p.PAUSE_MODES:
            raise BadBody(f"mode must be one of {list(p.PAUSE_MODES)}, got {mode!r}", "mode")
        async with self._call():
            if self.phase == IDLE:
                await self._begin(mode)
        return {"status": "paused"}

    async def resume(self) -> dict[str, Any]:
        """End a held round without a version: one ``/pause`` opened, or an update that has
        loaded nothing yet (a trainer giving up). Once loading began, only finishing ends it."""
        async with self._call():
            if self.began:
                raise OpenAIError("a weight update is loading: /finish_weight_update resumes the fleet (resuming "
                                  "now would serve half-loaded weights)", status=409)  # fmt: skip
            if self.phase != IDLE:
                await self._abort()
        return {"status": "resumed"}

    async def reset_prefix_cache(self, running: bool = False) -> dict[str, Any]:
        """Workers drop their prefix caches whenever a round ends (except in ``keep`` mode, by
        design): inside a round that is its end; outside one, a round of its own does it.
        While jobs run it answers ``success: false``, as vLLM, unless ``running`` (vLLM's
        ``reset_running_requests``): then the round cuts them, and they continue after it."""
        async with self._call():
            if self.phase != IDLE:
                return {"success": self.pause_mode != "keep"}
            if not running and (await self.status()).running:
                return {"success": False}
            await self._begin("abort")
            await self._abort()
        return {"success": True}

    async def expire(self, now: float) -> bool:
        """Abort the round if no call came for ``timeout_s`` (its trainer is gone); True if it did."""
        if self.round is None or self._busy or now - self._last < self.timeout_s:
            return False
        async with self._lock:
            if self.round is None or now - self._last < self.timeout_s:
                return False
            log.warning("weight transfer: no call for %.0f s in a %s round; aborting it%s", self.timeout_s,
                        self.phase, " (its workers restart from their checkpoint)" if self.began else "")  # fmt: skip
            await self._abort()
        return True

    # -- internals ------------------------------------------------------------------------
    @contextlib.asynccontextmanager
    async def _call(self) -> AsyncIterator[None]:
        async with self._lock:
            self._busy = True
            try:
                yield
            finally:
                self._busy = False
                self._last = self.clock()

    async def _begin(self, pause: str) -> None:
        rnd = SyncRound(self.sender, self.timeout_s)
        try:
            await rnd.step(p.Begin(pause))
        except BaseException:
            if rnd.round_id:
                with contextlib.suppress(Exception):
                    await rnd.step(p.Abort())
            raise
        self.round, self.phase, self.pause_mode = rnd, PAUSED, pause
        self.joined = self.began = False
        if self._watch is None or self._watch.done():
            self._watch = asyncio.ensure_future(self._watchdog())

    # The backend's part: when the members meet the trainer's group. gloo (ours): per round,
    # joined before loading begins (a trainer that never comes fails the join, and the workers
    # resume intact) and left before finishing. vLLM's NCCL (TRL's own client, not served yet):
    # a group made once at /init_weight_transfer_engine with a worker step that joins vLLM's
    # StatelessProcessGroup + PyNcclCommunicator, so these two would do nothing per round.
    async def _join(self, rnd: SyncRound, init: InitInfo) -> None:
        op = p.JoinGroup(init.master_address, init.master_port, init.backend, self.timeout_s, GROUP_NAME)
        await rnd.step(op)
        self.joined = True

    async def _leave(self, rnd: SyncRound) -> None:
        if self.joined:
            await rnd.step(p.LeaveGroup())
            self.joined = False

    async def _check_names(self, rnd: SyncRound, names: list[str]) -> None:
        """Refuse names a worker's checkpoint lacks while nothing is loaded yet (else the whole
        fleet would restart over a typo). A worker whose folder lists no names is not judged."""
        reply = await rnd.step(p.CheckNames(names))
        for ack in reply.acks:
            check = ack.result
            if isinstance(check, p.NameCheck) and check.unknown and (check.missing or len(check.unknown) < len(names)):
                raise BadBody(f"worker {ack.name}'s checkpoint has no tensors named {check.unknown[:10]}"
                              f"{'...' if len(check.unknown) > 10 else ''}", "update_info.names")  # fmt: skip

    async def _abort(self) -> None:
        """End the round without a version: members resume (or restart, if loading had begun)."""
        rnd = self.round
        self._ended()
        if rnd is not None and rnd.round_id:
            with contextlib.suppress(Exception):  # if it cannot go, the broker ends the round on its own
                await rnd.step(p.Abort())

    def _ended(self) -> None:
        self.round, self.phase, self.joined, self.began = None, IDLE, False, False

    async def _watchdog(self) -> None:
        while self.round is not None:
            left = self.timeout_s if self._busy else self._last + self.timeout_s - self.clock()
            await asyncio.sleep(max(0.05, left))
            await self.expire(self.clock())
