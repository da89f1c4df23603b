"""The worker: one engine, one DEALER to the broker, pull-based.

Lifecycle (Paranoid Pirate): connect under a fresh identity and say READY with credits;
heartbeat both ways; on DISCONNECT or broker silence, abort everything in flight (the
broker has requeued it) and reconnect fresh. If the engine dies, say DISCONNECT (so the
broker requeues at once) and exit non-zero; never hang.
"""

from __future__ import annotations

import asyncio
import logging
import os
import socket
import time
import uuid
from typing import Any

import zmq
import zmq.asyncio

from zmq_rollout import codec
from zmq_rollout import protocol as p
from zmq_rollout.batching import append
from zmq_rollout.config import WorkerConfig
from zmq_rollout.curve import HANDSHAKE_EVENTS, PeerKeys, handshake_failure, monitor_socket
from zmq_rollout.curve import refusal as curve_refusal
from zmq_rollout.errors import ProtocolError

from .control import SyncParticipant, refusal
from .engine import Engine, InvalidJob
from .generation import failure, run_job
from .loop_watch import LoopWatch
from .metrics import WorkerMetrics

log = logging.getLogger(__name__)

EXIT_OK = 0
EXIT_ENGINE_DEAD = 3
EXIT_INTERNAL = 1


class Worker:
    def __init__(self, config: WorkerConfig, engine: Engine, metrics: WorkerMetrics | None = None) -> None:
        self.config = config
        self.engine = engine
        self.name = config.name or f"{socket.gethostname()}-{os.getpid()}"
        self.metrics = metrics or WorkerMetrics(self.name, engine.vllm_metrics)
        self._ctx = zmq.asyncio.Context.instance()
        self._sock: zmq.asyncio.Socket | None = None
        self._curve = PeerKeys.from_files(config.curve_server_key, config.curve_secret_key, "WorkerConfig")
        self._handshake_task: asyncio.Task[None] | None = None
        self._refusals_logged: set[str] = set()
        self._decoder = codec.Decoder(codec.WORKER_FROM_BROKER)
        self._tasks: dict[int, asyncio.Task[None]] = {}  # ticket -> job task
        self._outgoing: list[list[Any]] = []  # [command, items] in send order
        self._flush_scheduled = False
        self._last_heard = 0.0
        self._packed = False
        """Whether to send the packed form: the broker said it reads it (``Liveness.packed``)."""
        self._sealed = False
        """Whether to send results as SEALED_FINAL: the broker said it reads it (``Liveness.sealed``)."""
        self._exit: asyncio.Future[int] | None = None
        self.sync = SyncParticipant(
            engine, lambda ack: self._send_now(p.CONTROL_ACK, ack), self._fatal, self.wait_for_jobs
        )

    # -- connection ------------------------------------------------------------------------
    def _connect(self) -> None:
        sock = self._ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.IDENTITY, f"{self.name}-{uuid.uuid4().hex[:6]}".encode())
        if self._curve is not None:
            self._curve.apply(sock)
        if self._handshake_task is not None:
            self._handshake_task.cancel()
        self._handshake_task = asyncio.ensure_future(self._handshakes(monitor_socket(sock, HANDSHAKE_EVENTS)))
        sock.connect(self.config.broker)
        self._sock = sock
        self._packed = self._sealed = False  # until this connection's broker says otherwise
        self._last_heard = time.monotonic()
        info = self.ready_info()
        self._send_now(p.READY, info)
        log.info("worker %s: READY to %s with %d credits", self.name, self.config.broker, info.credits)

    def ready_info(self) -> p.WorkerInfo:
        """What READY says: the credits are the engine's ``max_num_seqs`` plus ``extra_credits``."""
        return p.WorkerInfo(
            self.name,
            self.config.model,
            self.engine.max_num_seqs + self.config.extra_credits,
            self.engine.weight_version,
            self.capabilities(),
            self.engine.max_model_len,
            self.config.tensor_parallel_size,
        )

    def capabilities(self) -> list[str]:
        """What READY tells the broker (and ``status()`` the trainer) this worker can do."""
        can = ["generate", "stream", "chat", "text", p.TOKEN_BINS, p.SEALED_JOBS]
        can += ["weight_sync:shm", "weight_sync:gloo", "weight_sync:nccl"]
        if self.config.enable_lora:
            can.append("lora")
        return can

    async def _handshakes(self, monitor: zmq.asyncio.Socket) -> None:
        """Log once (per kind) that the broker refuses our CurveZMQ handshake; ZeroMQ retries."""
        from zmq.utils.monitor import parse_monitor_message

        try:
            while True:
                reason = handshake_failure(parse_monitor_message(await monitor.recv_multipart())["event"])
                if reason is not None and reason not in self._refusals_logged:
                    self._refusals_logged.add(reason)
                    why = curve_refusal(reason, self.config.broker, self._curve is not None)
                    log.error("worker %s: %s", self.name, why)
        finally:
            monitor.close(linger=0)

    async def _reconnect(self, reason: str) -> None:
        log.warning("worker %s: reconnecting (%s); aborting %d jobs", self.name, reason, len(self._tasks))
        self.sync.cancel()
        await self._abort_all()
        if self.engine.paused:  # evicted in the middle of a sync round
            await self.sync.resume_or_exit(f"reconnecting ({reason})")
        if self._sock is not None:
            self._sock.disable_monitor()  # before _connect closes its reader (Connection.close says why)
            self._sock.close(linger=0)
        self._outgoing.clear()
        self._connect()

    def _send_now(self, command: bytes, body: Any) -> None:
        assert self._sock is not None
        self._sock.send_multipart(codec.encode(command, body, packed=self._packed))

    def _queue(self, command: bytes, item: Any) -> None:
        """Send ``item`` soon, in one message with the others queued in this loop pass."""
        append(self._outgoing, command, item)
        if not self._flush_scheduled:
            self._flush_scheduled = True
            asyncio.get_running_loop().call_soon(self._flush)

    def _flush(self) -> None:
        self._flush_scheduled = False
        pending, self._outgoing = self._outgoing, []
        for command, items in pending:
            self._send_now(command, items)

    # -- main ------------------------------------------------------------------------------
    async def run(self) -> int:
        """Serve until stopped (``stop()``) or the engine dies; returns the exit code."""
        self._exit = asyncio.get_running_loop().create_future()
        if self.config.metrics_port is not None:
            self.metrics.serve(self.config.metrics_port, self.config.metrics_host)
        self._connect()
        background = [asyncio.ensure_future(c) for c in (self._receive(), self._heartbeat(), self._watch_engine())]
        for task in background:
            task.add_done_callback(self._background_ended)
        try:
            return await self._exit
        finally:
            if self._sock is not None:
                # The monitor stops before its reader closes: libzmq's I/O thread sends each event
                # with a blocking send, which a closed reader would hang (Connection.close).
                self._sock.disable_monitor()
            for ending in [*background, self._handshake_task]:
                if ending is not None:
                    ending.cancel()
            await self._abort_all()
            if self._sock is not None:
                self._send_now(p.DISCONNECT, None)  # the broker requeues at once
                self._sock.close(linger=0)
            self.metrics.close()

    def stop(self, code: int = EXIT_OK) -> None:
        if self._exit is not None and not self._exit.done():
            self._exit.set_result(code)

    def _background_ended(self, task: asyncio.Task[None]) -> None:
        """A loop of the worker ended while it runs: a bug. Exit rather than stay half alive
        (heartbeating but deaf), so that the broker requeues and a supervisor restarts us."""
        if self._exit is None or self._exit.done():
            return
        detail = "cancelled" if task.cancelled() else repr(task.exception())
        name = getattr(task.get_coro(), "__qualname__", "?")
        self._fatal(EXIT_INTERNAL, f"internal error: task {name} ended ({detail})")

    def _fatal(self, code: int, detail: str) -> None:
        log.error("worker %s: %s; exiting with code %d", self.name, detail, code)
        self.stop(code)

    def _engine_dead(self, detail: str) -> None:
        self._fatal(EXIT_ENGINE_DEAD, f"engine died ({detail})")

    async def _watch_engine(self) -> None:
        while True:
            await asyncio.sleep(0.5)
            if self.engine.errored:
                self._engine_dead("engine core reported an error")
                return

    async def _heartbeat(self) -> None:
        cfg = self.config
        watch = LoopWatch(cfg.heartbeat_interval_s, time.monotonic())
        while True:
            await asyncio.sleep(cfg.heartbeat_interval_s)
            now = time.monotonic()
            stall = watch.woke(now)
            if stall is not None:
                # The loop did not run (``loop_watch.py`` says why): silence it could not hear
                # is not the broker's, so it does not count towards broker_expiry_s.
                log.warning("worker %s: %s", self.name, stall)
                self.metrics.loop_stalled(stall.seconds)
                self._last_heard += stall.seconds
            if now - self._last_heard > cfg.broker_expiry_s and not self._messages_waiting():
                await self._reconnect("broker silent")
            else:
                self._send_now(p.HEARTBEAT, None)

    def _messages_waiting(self) -> bool:
        """Whether broker messages wait unread: a loop that was busy has not heard them yet,
        but the broker is not silent."""
        return self._sock is not None and bool(int(self._sock.getsockopt(zmq.EVENTS)) & zmq.POLLIN)

    async def _receive(self) -> None:
        while True:
            assert self._sock is not None
            sock = self._sock
            try:
                if not await sock.poll(100):
                    continue
                frames = await sock.recv_multipart()
            except (asyncio.CancelledError, zmq.ZMQError):
                if sock is self._sock:  # this task itself was cancelled, or the socket failed
                    raise
                continue  # a reconnect closed the socket under this read: read the new one
            self._last_heard = time.monotonic()
            try:
                msg = self._decoder.decode(frames)
            except ProtocolError as exc:
                self.metrics.malformed.inc()
                log.warning("worker %s: bad message from broker: %s", self.name, exc)
                control = codec.header_of(frames, p.CONTROL)
                if control is not None:  # answer it, or the round waits for its deadline
                    ack = refusal(control, str(exc), self.engine.weight_version)
                    if ack is not None:
                        self._send_now(p.CONTROL_ACK, ack)
                continue
            if msg.command == p.JOBS:
                for sealed in msg.body:
                    opened = p.unseal(sealed)
                    if isinstance(opened, p.Assignment):
                        self._start(opened)
                    else:  # a job it cannot run: answered alone, the others run
                        self.metrics.jobs_failed.labels("invalid_request").inc()
                        self._queue(p.ERROR, opened)
            elif msg.command == p.CANCEL:
                await self._cancel(msg.body)
            elif msg.command == p.DISCONNECT:
                await self._reconnect("broker said DISCONNECT")
            elif msg.command == p.CONTROL:
                self.sync.submit(msg.body)
            elif msg.command == p.HEARTBEAT and msg.body is not None:  # the broker's answer to READY
                self._packed, self._sealed = msg.body.packed, msg.body.sealed

    # -- jobs ------------------------------------------------------------------------------
    def _start(self, assignment: p.Assignment) -> None:
        ticket = assignment.ticket
        if ticket in self._tasks:
            return
        self._tasks[ticket] = asyncio.ensure_future(self._run_job(assignment))

    async def _run_job(self, assignment: p.Assignment) -> None:
        ticket, job = assignment.ticket, assignment.job
        started = time.monotonic()
        try:
            async for item in run_job(self.engine, str(ticket), job):
                item.key = ticket
                if isinstance(item, p.Delta):
                    self._queue(p.PARTIAL, item)
                else:
                    item.worker_id = self.name
                    self._queue(*p.final_item(item, self._sealed))
                    self.metrics.job_done(time.monotonic() - started, sum(len(s.token_ids) for s in item.samples))
        except asyncio.CancelledError:
            raise
        except (InvalidJob, ValueError, TypeError) as exc:
            self.metrics.jobs_failed.labels("invalid_request").inc()
            self._queue(p.ERROR, p.ErrorItem(ticket, "invalid_request", str(exc)))
        except Exception as exc:
            if self.engine.errored:
                self._engine_dead(repr(exc))
                return  # no answer: the broker requeues the job on another worker
            code, message = failure(exc, job)
            log.exception("worker %s: job %d failed (%s)", self.name, ticket, code)
            self.metrics.jobs_failed.labels(code).inc()
            self._queue(p.ERROR, p.ErrorItem(ticket, code, message))
        finally:
            self._tasks.pop(ticket, None)

    async def _cancel(self, tickets: list[int]) -> None:
        tasks = [self._tasks.pop(t) for t in tickets if t in self._tasks]
        for task in tasks:
            task.cancel()
        await self.engine.abort([str(t) for t in tickets])

    async def wait_for_jobs(self) -> None:
        """Until every running job has finished (a ``wait``-mode pause drains them so)."""
        while self._tasks:
            await asyncio.wait(list(self._tasks.values()))

    async def _abort_all(self) -> None:
        if self._tasks:
            await self._cancel(list(self._tasks))
