"""What peers send the broker, checked and handed to the scheduler.

The broker's side of the protocol's boundary: each message a client or a worker sends is
decoded here (``codec``) and turned into one call of the pure ``Scheduler``; what it answers
goes into the scheduler's outbox, which the socket loop (``server.py``) sends. Bad input is
answered (an ERROR naming each job id that can be read, ``salvage.py``) and counted here
(``stats.count_malformed``), and never reaches the scheduler: a bad message costs its sender
an error, no other peer anything. ``Broker`` (``server.py``) is this class plus its sockets.
"""

from __future__ import annotations

import logging
from typing import Any

from zmq_rollout import codec
from zmq_rollout import protocol as p
from zmq_rollout.config import BrokerConfig
from zmq_rollout.errors import ProtocolError

from .salvage import SUBMITS, split_submit, submit_ids, submitted
from .scheduler import Scheduler

log = logging.getLogger(__name__)

_RESULTS = (p.FINAL, p.SEALED_FINAL)
"""The commands that end tickets with a result (``Scheduler.worker_final``)."""


class Inbound:
    """The handlers of the clients' and the workers' messages, over the broker's state (set in
    ``Broker.__init__``)."""

    config: BrokerConfig
    scheduler: Scheduler
    epoch: str
    """This broker process's id in heartbeat replies: a client that sees it change resubmits."""
    _from_client: codec.Decoder
    _from_worker: codec.Decoder

    # -- clients ---------------------------------------------------------------------------
    def _reject(self, identity: bytes, reason: str, error: str, key: str | None = None, code: str = "protocol") -> None:
        self.scheduler.stats.count_malformed(reason)
        log.warning("bad message from client %r: %s", identity, error)
        self.scheduler.outbox.to_client(identity, p.ERROR, p.ErrorItem(key, code, error))

    def _reject_submit(self, identity: bytes, found: tuple[bytes, Any] | None, reason: str, error: str) -> None:
        """Refuse a whole message; a SUBMIT's refusal (``found``: its command and header,
        ``salvage.submitted``; else None) names each job whose id can be read (a client that
        asked for no ACCEPTED cannot tell which of its messages an error without a key is about)."""
        if found is not None:
            ids = submit_ids(found[1])
            if ids:
                self.scheduler.stats.count_malformed(reason)
                log.warning("bad message from client %r: %s", identity, error)
                for jid in ids:
                    self.scheduler.outbox.to_client(identity, p.ERROR, p.ErrorItem(jid, "protocol", error))
                return
        self._reject(identity, reason, error)

    def _on_client(self, identity: bytes, frames: list[Any], now: float) -> None:
        sched = self.scheduler
        size = sum(map(len, frames))
        if size > self.config.max_message_bytes:
            error = f"message of {size} bytes exceeds max_message_bytes={self.config.max_message_bytes}"
            self._reject_submit(identity, submitted(frames), "oversize", error)
            return
        try:
            msg = self._from_client.decode(frames)
        except ProtocolError as exc:
            found = submitted(frames)
            if found is not None:
                self._salvage_submit(identity, *found, now)
            else:
                self._reject(identity, "invalid", str(exc))
            return
        command = msg.command
        if command in SUBMITS:
            if len(msg.body) > p.MAX_JOBS_PER_MESSAGE:
                error = f"{len(msg.body)} jobs in one message; the limit is {p.MAX_JOBS_PER_MESSAGE}"
                self._reject_submit(identity, submitted(frames), "oversize", error)
                return
            sched.submit(identity, msg.body, now)
        elif command == p.HEARTBEAT:
            known = identity in sched.clients
            sched.client_seen(identity, now)
            answer = p.Liveness(self.epoch, new_session=not known, packed=True, token_bins=True, sealed_jobs=True)
            sched.outbox.to_client(identity, p.HEARTBEAT, answer)
        elif command == p.CANCEL:
            sched.cancel(identity, msg.body, now)
        elif command == p.STATUS:
            sched.client_seen(identity, now)
            sched.outbox.to_client(identity, p.STATUS_REPLY, sched.status(now))
        elif command == p.DISCONNECT:
            sched.client_gone(identity, "client disconnected", now)
        elif command == p.SYNC:
            sched.client_seen(identity, now)
            sched.sync.step(identity, msg.body, now)

    def _salvage_submit(self, identity: bytes, command: bytes, header: Any, now: float) -> None:
        try:
            jobs, errors = split_submit(header, command)
        except ProtocolError as exc:
            self._reject(identity, "invalid", str(exc))
            return
        if len(jobs) + len(errors) > p.MAX_JOBS_PER_MESSAGE:
            n = len(jobs) + len(errors)
            error = f"{n} jobs in one message; the limit is {p.MAX_JOBS_PER_MESSAGE}"
            self._reject_submit(identity, (command, header), "oversize", error)
            return
        self.scheduler.stats.rejected_invalid += len(errors)
        for err in errors:
            self._reject(identity, "invalid_job", err.message, err.key, "invalid_request")  # type: ignore[arg-type]
        if jobs:
            self.scheduler.submit(identity, jobs, now)

    # -- workers ---------------------------------------------------------------------------
    def _on_worker(self, identity: bytes, frames: list[Any], now: float) -> None:
        sched = self.scheduler
        try:
            msg = self._from_worker.decode(frames)
        except ProtocolError as exc:
            sched.stats.count_malformed("worker")
            log.warning("bad message from worker %r: %s", identity, exc)
            sched.worker_seen(identity, now)
            return
        command, body = msg.command, msg.body
        if command in _RESULTS:
            sched.worker_final(identity, body, now)
        elif command == p.PARTIAL:
            sched.worker_partial(identity, body, now)
        elif command == p.HEARTBEAT:
            sched.worker_seen(identity, now)
        elif command == p.READY:
            sched.worker_ready(identity, body, now)
            # Tells the worker this broker reads the packed form and SEALED_FINAL (an older worker
            # ignores the body).
            sched.outbox.to_worker(identity, p.HEARTBEAT, p.Liveness(self.epoch, packed=True, sealed=True))
        elif command == p.ERROR:
            sched.worker_error(identity, body, now)
        elif command == p.CREDIT:
            sched.worker_credit(identity, body, now)
        elif command == p.DISCONNECT:
            sched.worker_gone(identity, "worker left", now)
        elif command == p.CONTROL_ACK and sched.worker_seen(identity, now) is not None:
            sched.sync.ack(identity, body, now)
