"""The worker's half of a weight-sync round: CONTROL steps in, CONTROL_ACKs out.

Steps run one at a time, in order, on their own task, so heartbeats and token streams go on
while a step waits on the engine. ``SyncParticipant.handlers`` maps each step type to what
the worker does: pause or resume the engine, compare names, keep a LoRA bucket, or forward a
data step into vLLM's worker processes (``Engine.sync_in_engine``, handled there by
``receiver.Receiver``).

A worker whose weights were partly overwritten by a round that then failed cannot say
which weights it holds; it exits with ``EXIT_WEIGHTS_DIRTY`` so that its supervisor
restarts it from the checkpoint, and it rejoins as a late joiner.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Awaitable, Callable
from typing import Any

import msgspec

from zmq_rollout import codec
from zmq_rollout import protocol as p
from zmq_rollout.weight_sync.buckets import unpack
from zmq_rollout.weight_sync.cuda_ipc import BucketLayouts, UnknownLayout

from .engine import Engine

log = logging.getLogger(__name__)

EXIT_WEIGHTS_DIRTY = 4

Handler = Callable[[Any, p.Control], Awaitable[p.AckResult]]


def refusal(header: bytes, error: str, weight_version: int) -> p.ControlAck | None:
    """The answer to a CONTROL that does not decode (say, a step newer than this worker):
    ``ok: false`` with the reason, so the round goes on without waiting for a deadline.
    None if not even the round can be read."""
    try:
        raw = msgspec.msgpack.decode(header)
    except codec.DECODE_ERRORS:
        return None
    if not (isinstance(raw, list) and raw and type(raw[0]) is int):
        return None
    op = raw[1][0] if len(raw) > 1 and isinstance(raw[1], list) and raw[1] and isinstance(raw[1][0], str) else "?"
    return p.ControlAck(raw[0], op, False, weight_version, f"ProtocolError: {error}")


def total(results: list[Any]) -> p.AckResult:
    """One answer from the per-rank results of a call into the engine: counts add up."""
    if results and all(type(r) is int for r in results):
        return sum(results)
    if all(r is None for r in results):
        return None
    raise ValueError(f"the engine's ranks answered {results!r}")


def _retrieve(task: asyncio.Future[Any]) -> None:
    """Log the failure of a pause nobody awaits (the round ended first)."""
    if not task.cancelled() and task.exception() is not None:
        log.error("pausing the engine failed: %r", task.exception())


class SyncParticipant:
    def __init__(
        self,
        engine: Engine,
        send_ack: Callable[[p.ControlAck], None],
        fatal: Callable[[int, str], None],
        drain: Callable[[], Awaitable[None]],
    ) -> None:
        self.engine = engine
        self._drain = drain
        self._send_ack = send_ack
        self._fatal = fatal
        self._steps: asyncio.Queue[p.Control] = asyncio.Queue()
        self._task: asyncio.Task[None] | None = None
        self.dirty = False
        """Weights partly overwritten and not yet committed."""
        self._lora_parts: dict[str, Any] = {}
        self._pausing: asyncio.Future[Any] | None = None
        """A ``wait``-mode pause sent into the engine and not yet answered (``_paused``)."""
        self.round_ms: dict[str, float] = {}
        """This round's milliseconds on this worker, by step and by engine call (logged at commit)."""
        self.layouts = BucketLayouts()
        """The ``load_ipc2`` and ``load_ipc_tensors`` layouts its engine was sent in full (the
        engine keeps the same ones)."""
        self.handlers: dict[type[p.SyncOp], Handler] = {
            p.Begin: self.begin,
            p.CheckNames: self.check_names,
            p.BeginUpdate: self.in_engine,
            p.LoadShm: self.load,
            p.LoadIpc: self.load,
            p.LoadIpcTensors: self.load,
            p.JoinGroup: self.in_engine,
            p.ReceiveBucket: self.in_engine,
            p.LeaveGroup: self.in_engine,
            p.FinishUpdate: self.in_engine,
            p.LoraBucket: self.lora_bucket,
            p.LoadLora: self.load_lora,
            p.Commit: self.commit,
            p.Abort: self.abort,
        }

    def submit(self, control: p.Control) -> None:
        if self._task is None or self._task.done():
            self._task = asyncio.ensure_future(self._loop())
        self._steps.put_nowait(control)

    async def _loop(self) -> None:
        while True:
            control = await self._steps.get()
            op = control.op
            started = time.perf_counter()
            if isinstance(op, p.Begin):
                self.round_ms = {}
            try:
                result = await self.handlers[type(op)](op, control)
                ack = p.ControlAck(control.round_id, op.kind, True, self.engine.weight_version, "", result)
            except Exception as exc:
                log.exception("sync step %s failed", op.kind)
                message = f"{type(exc).__name__}: {exc}"
                ack = p.ControlAck(control.round_id, op.kind, False, self.engine.weight_version, message)
            self._add_ms(op.kind, started)
            self._send_ack(ack)

    def _add_ms(self, what: str, started: float) -> None:
        self.round_ms[what] = self.round_ms.get(what, 0.0) + (time.perf_counter() - started) * 1e3

    async def _timed(self, what: str, call: Awaitable[Any]) -> Any:
        started = time.perf_counter()
        try:
            return await call
        finally:
            self._add_ms(what, started)

    # -- the steps -------------------------------------------------------------------------
    async def begin(self, op: p.Begin, control: p.Control) -> int:
        """Pause generating; answers with the ranks this worker brings to a collective."""
        if op.pause != "wait":
            await self._timed("pause", self.engine.pause(op.pause))
            return self.engine.config.tensor_parallel_size
        # Let our own jobs finish first (the broker sends no new ones during a round): every
        # job in flight finishes on the old weights, whatever vLLM's own "wait" counts as in
        # flight. Then the engine holds no request, so its pause completes at once, and every
        # later call into it queues behind the pause: the ack need not wait for its answer
        # (the next step that calls the engine does, ``_paused``).
        await self._drain()
        self._pausing = asyncio.ensure_future(self._timed("pause", self.engine.pause(op.pause)))
        self._pausing.add_done_callback(_retrieve)
        await asyncio.sleep(0)  # the pause leaves for the engine (and our own gate closes) before the ack
        return self.engine.config.tensor_parallel_size

    async def _paused(self) -> None:
        """Wait for the answer to a pause sent by ``begin``; raises if the pause failed."""
        pausing, self._pausing = self._pausing, None
        if pausing is not None:
            await pausing

    async def check_names(self, op: p.CheckNames, control: p.Control) -> p.NameCheck:
        have, sent = self.engine.checkpoint_names(), set(op.names)
        return p.NameCheck(sorted(have - sent), sorted(sent - have))

    async def in_engine(self, op: p.SyncOp, control: p.Control) -> p.AckResult:
        await self._paused()
        if isinstance(op, p.BeginUpdate):
            self.dirty = True
        return total(await self._timed("engine", self.engine.sync_in_engine(control)))

    async def load(self, op: p.LoadShm | p.LoadIpc | p.LoadIpcTensors, control: p.Control) -> p.AckResult:
        """A bucket (or, ``load_ipc_tensors``, all the trainer's tensors); the first may begin
        the update and the last finish it. A ``load_ipc2`` or ``load_ipc_tensors`` whose layout
        its engine was never sent fails at once, the weights untouched."""
        if isinstance(op, p.LoadShm):
            return await self._load(op, control)
        full = self.layouts.carries_layout(op)
        if not full and op.layout not in self.layouts:
            raise UnknownLayout(f"{p.UNKNOWN_LAYOUT} {op.layout!r}: never sent to this worker")
        result = await self._load(op, control)
        if full:
            self.layouts.remember(op)  # the engine holds it now
        return result

    async def _load(self, op: p.LoadShm | p.LoadIpc | p.LoadIpcTensors, control: p.Control) -> p.AckResult:
        await self._paused()  # before any weight moves: a failed pause leaves them clean
        self.dirty = self.dirty or op.begin
        if not op.finish:
            return await self.in_engine(op, control)
        # The last bucket: the engine calls go out together and run in order in the engine
        # (load and finish, reset the prefix cache, and in wait mode let vLLM's scheduler run
        # again: no request is in the engine, and none enters before commit opens our own
        # gate), so that commit makes no call into the engine. In abort and keep modes vLLM
        # holds requests (queued, or frozen with their KV) that must not run before commit.
        calls = [
            self._timed("engine", self.engine.sync_in_engine(control)),
            self._timed("clear_cache", self.engine.clear_prefix_cache()),
        ]
        if self.engine.pause_mode == "wait":
            calls.append(self._timed("resume_scheduler", self.engine.resume_scheduler()))
        results, *_ = await asyncio.gather(*calls)
        return total(results)

    async def lora_bucket(self, op: p.LoraBucket, control: p.Control) -> int:
        """An adapter's bytes, inline; kept in this process until ``load_lora``."""
        import torch

        if op.first:
            self._lora_parts = {}
        buf = torch.frombuffer(bytearray(op.data), dtype=torch.uint8)
        for name, tensor in unpack(op.bucket, buf):
            self._lora_parts[name] = tensor.clone()
        return len(op.bucket.tensors)

    async def load_lora(self, op: p.LoadLora, control: p.Control) -> int:
        await self._paused()
        parts, self._lora_parts = self._lora_parts, {}
        return await self.engine.load_lora(op.adapter, parts, dict(op.peft_config))

    async def commit(self, op: p.Commit, control: p.Control) -> int:
        await self._paused()
        self.engine.weight_version = op.version
        self.dirty = False
        await self._timed("resume", self.engine.resume())
        log.info(
            "weights at version %d; this round on the worker (ms): %s",
            op.version,
            " ".join(f"{k} {v:.2f}" for k, v in self.round_ms.items()),
        )
        return op.version

    async def abort(self, op: p.Abort, control: p.Control) -> None:
        await self.resume_or_exit("the sync round was aborted")

    # -- leaving ---------------------------------------------------------------------------
    async def resume_or_exit(self, why: str) -> None:
        """Leave a round without committing: resume if the weights are intact, else exit."""
        if self.dirty:
            self._fatal(EXIT_WEIGHTS_DIRTY, f"{why} after weights were partly overwritten; restart to reload them")
            return
        with contextlib.suppress(Exception):  # a failed pause was logged; resume all the same
            await self._paused()
        await self.engine.resume()

    def cancel(self) -> None:
        if self._task is not None:
            self._task.cancel()
        self._steps = asyncio.Queue()
