"""Test doubles. NOT the product: the real worker is ``zmq_rollout.workers`` around vLLM.

``EchoWorkerDouble`` speaks the worker side of the protocol and answers every job at once
with a fake completion. It exists to measure and test the *broker* (throughput, requeue,
cancel) without an engine's cost hiding the broker's. It also acknowledges every step of a
weight-sync round at once (moving no bytes), so that rounds can run against doubles
(``benchmarks/chaos.py`` syncs between its kills).
"""

from __future__ import annotations

import contextlib
import threading
import time
import uuid
from collections.abc import Callable
from typing import Any

import zmq

from zmq_rollout import codec
from zmq_rollout import protocol as p
from zmq_rollout.batching import append
from zmq_rollout.curve import PeerKeys


def echo_result(assignment: p.Assignment, name: str, weight_version: int) -> p.Result:
    """A fake completion: the prompt's token ids (or its length) echoed back."""
    job = assignment.job
    ids = job.prompt_token_ids  # a list: a token bin is opened on decode
    prompt_ids = ids if isinstance(ids, list) and ids else [len(job.prompt or "")]
    samples = [
        p.Sample(i, list(prompt_ids[:4]), [0.0] * min(4, len(prompt_ids)), "length") for i in range(job.sampling.n)
    ]
    return p.Result(assignment.ticket, prompt_ids, samples, weight_version, name)


def _send_if_connected(sock: zmq.Socket[Any], command: bytes, packed: bool) -> None:
    """Never block: a DEALER whose handshake was refused has no connection to queue on."""
    with contextlib.suppress(zmq.Again):
        sock.send_multipart(codec.encode(command, packed=packed), zmq.NOBLOCK)


class EchoWorkerDouble:
    """A worker double. ``run()`` serves until ``stop()``; ``die()`` stops without a goodbye,
    like a SIGKILLed process (the broker must notice by heartbeat expiry).

    ``hold=True`` keeps jobs without answering them until ``release()``, to test requeue.
    CONTROL (a weight-sync step) is acknowledged at once with ``ok`` (see ``sync_ack``);
    ``commit`` sets ``weight_version``, which the next READY announces.

    Like the real worker, it sends the packed form and SEALED_FINAL (for the results worth
    sealing) once the broker's answer to READY says the broker reads them; ``split_only=True``
    keeps the split form and FINAL, as a worker older than both.
    """

    def __init__(
        self,
        address: str,
        *,
        credits: int = 64,
        name: str | None = None,
        heartbeat: float = 0.2,
        hold: bool = False,
        weight_version: int = 0,
        curve: PeerKeys | None = None,
        split_only: bool = False,
        answer: Callable[[p.Assignment, str, int], p.Result] = echo_result,
    ) -> None:
        self.address = address
        self.answer = answer
        """What it answers a job with: ``answer(assignment, name, weight_version)``."""
        self.split_only = split_only
        self._packed = self._sealed = False
        self.curve = curve
        self.name = name or f"echo-double-{uuid.uuid4().hex[:6]}"
        self.credits = credits
        self.heartbeat = heartbeat
        self.hold = hold
        self.weight_version = weight_version
        self.held: list[p.Assignment] = []
        self.received: list[p.Assignment] = []
        self.cancelled: list[int] = []
        self.disconnects = 0
        self.sealed_sent = 0
        """Results it sent as SEALED_FINAL (those ``p.worth_sealing``, once told)."""
        self._stop = threading.Event()
        self._silent = False
        self._thread: threading.Thread | None = None

    def start(self) -> EchoWorkerDouble:
        self._thread = threading.Thread(target=self.run, name=self.name, daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)

    def die(self) -> None:
        self._silent = True
        self.stop()

    def run(self) -> None:
        ctx: zmq.Context[Any] = zmq.Context.instance()
        decoder = codec.Decoder(codec.WORKER_FROM_BROKER)
        sock = self._connect(ctx)
        next_beat = time.monotonic() + self.heartbeat
        try:
            while not self._stop.is_set():
                if sock.poll(int(self.heartbeat * 1000 / 2)):
                    while True:
                        try:
                            frames = sock.recv_multipart(zmq.NOBLOCK)
                        except zmq.Again:
                            break
                        sock = self._handle(ctx, sock, decoder.decode(frames))
                if time.monotonic() >= next_beat:
                    _send_if_connected(sock, p.HEARTBEAT, self._packed)
                    next_beat = time.monotonic() + self.heartbeat
            if not self._silent:
                _send_if_connected(sock, p.DISCONNECT, self._packed)
        finally:
            sock.close(linger=0)

    def _connect(self, ctx: zmq.Context[Any]) -> zmq.Socket[Any]:
        sock = ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.IDENTITY, f"{self.name}-{uuid.uuid4().hex[:6]}".encode())
        if self.curve is not None:
            self.curve.apply(sock)
        sock.connect(self.address)
        self._packed = self._sealed = False  # until this connection's broker says it reads them
        can = ["echo", p.TOKEN_BINS, p.SEALED_JOBS]
        info = p.WorkerInfo(self.name, "echo-double", self.credits, self.weight_version, can)
        sock.send_multipart(codec.encode(p.READY, info))
        return sock

    def _handle(self, ctx: zmq.Context[Any], sock: zmq.Socket[Any], msg: codec.Message) -> zmq.Socket[Any]:
        if msg.command == p.JOBS:
            opened = [p.unseal(sealed) for sealed in msg.body]
            jobs = [a for a in opened if isinstance(a, p.Assignment)]
            refused = [e for e in opened if isinstance(e, p.ErrorItem)]
            if refused:  # as the worker answers a job it cannot run
                sock.send_multipart(codec.encode(p.ERROR, refused, packed=self._packed))
            self.received.extend(jobs)
            if self.hold:
                self.held.extend(jobs)
            elif jobs:
                segments: list[list[Any]] = []  # coalesced as the worker's (FINAL, SEALED_FINAL)
                for a in jobs:
                    append(segments, *p.final_item(self.answer(a, self.name, self.weight_version), self._sealed))
                for command, items in segments:
                    sock.send_multipart(codec.encode(command, items, packed=self._packed))
                    if command == p.SEALED_FINAL:
                        self.sealed_sent += len(items)
        elif msg.command == p.CANCEL:
            self.cancelled.extend(msg.body)
            self.held = [a for a in self.held if a.ticket not in msg.body]
        elif msg.command == p.CONTROL:
            sock.send_multipart(codec.encode(p.CONTROL_ACK, self.sync_ack(msg.body), packed=self._packed))
        elif msg.command == p.HEARTBEAT and msg.body is not None and not self.split_only:
            self._packed, self._sealed = msg.body.packed, msg.body.sealed
        elif msg.command == p.DISCONNECT:
            self.disconnects += 1
            sock.close(linger=0)
            return self._connect(ctx)
        return sock

    def sync_ack(self, control: p.Control) -> p.ControlAck:
        """A sync step, done at once and touching no bytes: ``begin`` brings one rank,
        ``check_names`` finds no mismatch, ``commit`` takes its version; the rest succeed."""
        op = control.op
        result: p.AckResult = None
        if isinstance(op, p.Begin):
            result = 1
        elif isinstance(op, p.CheckNames):
            result = p.NameCheck([], [])
        elif isinstance(op, p.Commit):
            self.weight_version = result = op.version
        return p.ControlAck(control.round_id, op.kind, True, self.weight_version, "", result)

    def release(self) -> None:
        """Stop holding (new jobs are answered; held ones stay unanswered)."""
        self.hold = False
