"""Weight-sync rounds: the broker's half of the control plane, as a pure state machine.

A round belongs to one trainer and holds a fixed set of workers (every worker registered
when it began). The trainer drives it step by step (``SyncStep``); each step is a barrier:
the broker sends the step to every member as CONTROL, collects their CONTROL_ACKs, and
answers the trainer with one SYNC_REPLY when all have answered *or the step's timeout
passes*. A member that misses the deadline is evicted (DISCONNECT, its jobs requeued): it
rejoins as a fresh worker with the version it holds (or exits and restarts if its weights
were partly overwritten), and gets no jobs until its version is the fleet's.
Nothing here can wait forever: every step has a deadline, and a round whose trainer goes
silent for ``round_idle_timeout_s`` is aborted and its workers resumed.

States of a round::

    begin ──> data steps (check_names, begin_update, load_shm | load_ipc2 | load_ipc_tensors
                          | join_group, receive_bucket, leave_group, finish_update, lora_bucket,
                          load_lora)
          ──> commit ──> done
       └───────────── abort (from the trainer, or the trainer lost) ─────────────┘

The coordinator needs four things of the scheduler (``Fleet``): the workers, the outbox,
the stats, and two events back (a worker is lost, the round ended).
"""

from __future__ import annotations

import itertools
import logging
from dataclasses import dataclass, field
from typing import Protocol

from zmq_rollout import protocol as p

from .outbox import Outbox
from .state import WorkerId, WorkerState
from .stats import BrokerStats, loss_reason

log = logging.getLogger(__name__)


class Fleet(Protocol):
    """What a round needs of the broker's scheduler."""

    workers: dict[WorkerId, WorkerState]
    outbox: Outbox
    stats: BrokerStats

    def worker_gone(self, identity: WorkerId, reason: str, now: float) -> None:
        """Purge a worker and requeue its jobs."""

    def dispatch_soon(self, now: float) -> None:
        """Workers may take jobs again."""

    def workers_changed(self) -> None:
        """Which workers take jobs changed (``accepting``)."""


@dataclass(eq=False)
class Step:
    op: str
    deadline: float
    waiting: set[WorkerId]
    acks: dict[WorkerId, p.WorkerAck] = field(default_factory=dict)
    evicted: list[p.Evicted] = field(default_factory=list)
    sent: float = 0.0
    nbytes: int = 0
    """Bytes of the bucket the step loads (0 for a step without one)."""


@dataclass(eq=False)
class Round:
    round_id: int
    client: bytes
    members: dict[WorkerId, int]  # worker identity -> its ranks in a collective (its TP size)
    names: dict[WorkerId, str]
    last_activity: float
    started: float = 0.0
    step: Step | None = None
    lost: list[p.Evicted] = field(default_factory=list)  # members lost between steps, not yet reported


class SyncCoordinator:
    def __init__(self, fleet: Fleet, round_idle_timeout_s: float = 300.0) -> None:
        self.fleet = fleet
        self.round_idle_timeout_s = round_idle_timeout_s
        self.round: Round | None = None
        self.fleet_version = 0
        """The newest weight version a round has committed (0 before the first)."""
        self._ids = itertools.count(1)
        self.num_rounds = 0
        self.num_evicted = 0

    def holds(self, worker: WorkerId) -> bool:
        return self.round is not None and worker in self.round.members

    def is_current(self, worker: WorkerState) -> bool:
        """Whether ``worker`` holds the fleet's weights (else it is stale: no jobs)."""
        return worker.weight_version >= self.fleet_version

    # -- trainer ---------------------------------------------------------------------------
    def step(self, client: bytes, msg: p.SyncStep, now: float) -> None:
        rnd = self.round
        if isinstance(msg.op, p.Begin):
            if rnd is not None:
                self._refuse(client, msg, f"sync round {rnd.round_id} is still running; one round at a time")
                return
            self._begin(client, msg, now)
            return
        if rnd is None or rnd.round_id != msg.round_id or rnd.client != client:
            self._refuse(client, msg, f"no sync round {msg.round_id} of this client is running")
            return
        if rnd.step is not None:
            self._refuse(client, msg, f"step {rnd.step.op!r} of round {rnd.round_id} is still running")
            return
        self._send_step(rnd, msg, now)

    def _refuse(self, client: bytes, msg: p.SyncStep, error: str) -> None:
        reply = p.SyncReply(msg.round_id, msg.op.kind, [], [], self.fleet_version, error)
        self.fleet.outbox.to_client(client, p.SYNC_REPLY, reply)

    def _begin(self, client: bytes, msg: p.SyncStep, now: float) -> None:
        workers = self.fleet.workers
        members = {}
        for identity, w in workers.items():
            members[identity] = max(1, w.info.num_ranks)
            w.accepting = False  # no new jobs until the round ends for it
        self.fleet.workers_changed()
        names = {i: workers[i].info.name for i in members}
        rnd = self.round = Round(next(self._ids), client, members, names, now, started=now)
        assert isinstance(msg.op, p.Begin)
        log.info("sync round %d begins: %d workers, pause=%s", rnd.round_id, len(members), msg.op.pause)
        self._send_step(rnd, msg, now)

    def _send_step(self, rnd: Round, msg: p.SyncStep, now: float) -> None:
        rnd.last_activity = now
        bucket = getattr(msg.op, "bucket", None)
        nbytes = bucket.nbytes if isinstance(bucket, p.Bucket) else 0
        rnd.step = Step(msg.op.kind, now + msg.timeout_s, set(rnd.members), sent=now, nbytes=nbytes)
        # Ranks are laid out over the members still in the round: trainer 0, then each worker's.
        world, offset = 1 + sum(rnd.members.values()), 1
        for identity, ranks in rnd.members.items():
            self.fleet.outbox.to_worker(identity, p.CONTROL, p.Control(rnd.round_id, msg.op, offset, world))
            offset += ranks
        self._maybe_done(rnd, now)

    # -- workers ---------------------------------------------------------------------------
    def ack(self, worker: WorkerId, ack: p.ControlAck, now: float) -> None:
        rnd = self.round
        if rnd is None or ack.round_id != rnd.round_id or rnd.step is None or worker not in rnd.step.waiting:
            self.fleet.stats.late_replies += 1
            return
        step = rnd.step
        step.waiting.discard(worker)
        step.acks[worker] = p.WorkerAck(rnd.names[worker], ack.ok, ack.result, ack.message)
        if ack.ok and step.op == "commit":
            w = self.fleet.workers.get(worker)
            if w is not None:
                w.weight_version = ack.weight_version
        self._maybe_done(rnd, now)

    def forget(self, worker: WorkerId, reason: str, now: float) -> None:
        """A member left (expired, evicted, disconnected): the round goes on without it."""
        rnd = self.round
        if rnd is None or worker not in rnd.members:
            return
        name = rnd.names[worker]
        del rnd.members[worker]
        self.fleet.stats.sync.evictions[loss_reason(reason)] += 1
        if rnd.step is not None and worker in rnd.step.waiting:
            rnd.step.waiting.discard(worker)
            rnd.step.evicted.append(p.Evicted(name, reason))
            self._maybe_done(rnd, now)
        else:
            rnd.lost.append(p.Evicted(name, reason))  # reported with the next step's reply

    def _maybe_done(self, rnd: Round, now: float) -> None:
        step = rnd.step
        if step is None or step.waiting:
            return
        rnd.step = None
        rnd.last_activity = now
        num_ok = sum(1 for a in step.acks.values() if a.ok)
        num_failed = len(step.acks) - num_ok
        self.fleet.stats.sync.step_done(step.op, now - step.sent, num_ok, num_failed, step.nbytes)
        workers = self.fleet.workers
        if step.op == "begin":  # a worker that could not pause takes no part in the round
            for identity in [i for i in rnd.members if i in step.acks and not step.acks[i].ok]:
                del rnd.members[identity]
                w = workers.get(identity)
                if w is not None:
                    w.accepting = self.is_current(w)
                    self.fleet.workers_changed()
        if rnd.lost:
            step.evicted[:0], rnd.lost = rnd.lost, []
        if step.op == "commit":
            versions = [a.result for a in step.acks.values() if a.ok and type(a.result) is int]
            self.fleet_version = max([self.fleet_version, *versions])
        reply = p.SyncReply(rnd.round_id, step.op, list(step.acks.values()), step.evicted, self.fleet_version)
        self.fleet.outbox.to_client(rnd.client, p.SYNC_REPLY, reply)
        if step.op == "commit":
            self._end(rnd, now, "commit done", "committed" if num_ok and not num_failed else "failed")
        elif step.op == "abort":
            self._end(rnd, now, "abort done", "aborted")

    def _end(self, rnd: Round, now: float, why: str, outcome: str) -> None:
        self.round = None
        self.num_rounds += 1
        self.fleet.stats.sync.round_done(outcome, now - rnd.started)
        for w in self.fleet.workers.values():  # members, and any worker that joined during the round
            w.accepting = self.is_current(w)
        self.fleet.workers_changed()
        log.info("sync round %d ended (%s); fleet version %d", rnd.round_id, why, self.fleet_version)
        self.fleet.dispatch_soon(now)

    # -- time and loss ---------------------------------------------------------------------
    def tick(self, now: float) -> None:
        rnd = self.round
        if rnd is None:
            return
        step = rnd.step
        if step is not None and now > step.deadline:
            for identity in list(step.waiting):
                self.evict(identity, f"no answer to {step.op!r} within its timeout", now)
        elif step is None and now - rnd.last_activity > self.round_idle_timeout_s:
            self.abort(rnd, now, f"trainer silent for {self.round_idle_timeout_s} s (round_idle_timeout_s)")

    def evict(self, worker: WorkerId, reason: str, now: float) -> None:
        self.num_evicted += 1
        log.warning("evicting worker %r from the sync round: %s", worker, reason)
        self.fleet.outbox.to_worker(worker, p.DISCONNECT, None)
        self.fleet.worker_gone(worker, f"evicted: {reason}", now)

    def client_gone(self, client: bytes, now: float) -> None:
        rnd = self.round
        if rnd is not None and rnd.client == client:
            self.abort(rnd, now, "trainer disconnected")

    def abort(self, rnd: Round, now: float, why: str) -> None:
        """Tell every member to abort (resume with the weights it has); no reply (the trainer is gone)."""
        for identity in rnd.members:
            self.fleet.outbox.to_worker(identity, p.CONTROL, p.Control(rnd.round_id, p.Abort()))
        self._end(rnd, now, f"aborted: {why}", "trainer_lost")
