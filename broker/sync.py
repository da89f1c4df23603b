"""Weight-sync rounds: the broker's half of the control plane, as a pure state machine.

A round belongs to one trainer and holds a fixed set of workers (every worker registered
when it began). The trainer drives it step by step (``SyncStep``); each step is a barrier:
the broker sends the step to every member as CONTROL, collects their CONTROL_ACKs, and
answers the trainer with one SYNC_REPLY when all have answered *or the step's timeout
passes*. A member that misses the deadline is evicted (DISCONNECT, its jobs requeued): it
rejoins as a fresh worker with the version it holds (or exits and restarts if its weights
were partly overwritten), and gets no jobs until its version is the fleet's.
Nothing here can wait forever: every step has a deadline, and a round whose trainer goes
silent for ``round_idle_timeout`` is aborted and its workers resumed.

States of a round::

    begin ──> [pause] ──> data steps (begin_update, load_shm | join_group, receive_bucket,
                                      leave_group, finish_update, check_names) ──> commit ──> done
                   └──────────────────────────── abort (or trainer lost) ──────────────────┘
"""

from __future__ import annotations

import itertools
import logging
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from zmq_rollout import protocol as p

if TYPE_CHECKING:
    from .scheduler import Scheduler

log = logging.getLogger(__name__)

# The worker-side op for each trainer op (others go through unchanged).
WORKER_OP = {"begin": "pause", "abort": "resume"}


@dataclass(eq=False)
class Step:
    op: str
    deadline: float
    waiting: set[bytes]
    acks: dict[bytes, p.WorkerAck] = field(default_factory=dict)
    evicted: list[p.Evicted] = field(default_factory=list)


@dataclass(eq=False)
class Round:
    round_id: int
    client: bytes
    members: dict[bytes, int]  # worker identity -> its ranks in a collective (its TP size)
    names: dict[bytes, str]
    last_activity: float
    step: Step | None = None
    lost: list[p.Evicted] = field(default_factory=list)  # members lost between steps, not yet reported


class SyncCoordinator:
    def __init__(self, scheduler: Scheduler, round_idle_timeout: float = 300.0) -> None:
        self.scheduler = scheduler
        self.round_idle_timeout = round_idle_timeout
        self.round: Round | None = None
        self._ids = itertools.count(1)
        self.num_rounds = 0
        self.num_evicted = 0

    def holds(self, worker: bytes) -> bool:
        return self.round is not None and worker in self.round.members

    # -- trainer ---------------------------------------------------------------------------
    def step(self, client: bytes, msg: p.SyncStep, now: float) -> None:
        rnd = self.round
        if msg.op == "begin":
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
        reply = p.SyncReply(msg.round_id, msg.op, [], [], self.scheduler.fleet_version, error)
        self.scheduler.outbox.to_client(client, p.SYNC_REPLY, reply)

    def _begin(self, client: bytes, msg: p.SyncStep, now: float) -> None:
        mode = msg.args.get("pause", "wait")
        if mode not in p.PAUSE_MODES:
            self._refuse(client, msg, f"pause={mode!r}; expected one of {sorted(p.PAUSE_MODES)}")
            return
        workers = self.scheduler.workers
        members = {}
        for identity, w in workers.items():
            members[identity] = max(1, w.info.num_ranks)
            w.accepting = False  # no new jobs until the round ends for it
        rnd = self.round = Round(next(self._ids), client, members, {i: workers[i].info.name for i in members}, now)
        log.info("sync round %d begins: %d workers, pause=%s", rnd.round_id, len(members), mode)
        self._send_step(rnd, msg, now)

    def _send_step(self, rnd: Round, msg: p.SyncStep, now: float) -> None:
        rnd.last_activity = now
        rnd.step = Step(msg.op, now + msg.timeout, set(rnd.members))
        op = WORKER_OP.get(msg.op, msg.op)
        # Ranks are laid out over the members still in the round: trainer 0, then each worker's.
        world, offset = 1 + sum(rnd.members.values()), 1
        for identity, ranks in rnd.members.items():
            args = {**msg.args, "rank_offset": offset, "world_size": world}
            self.scheduler.outbox.to_worker(identity, p.CONTROL, p.Control(rnd.round_id, op, args))
            offset += ranks
        self._maybe_done(rnd, now)

    # -- workers ---------------------------------------------------------------------------
    def ack(self, worker: bytes, ack: p.ControlAck, now: float) -> None:
        rnd = self.round
        if rnd is None or ack.round_id != rnd.round_id or rnd.step is None or worker not in rnd.step.waiting:
            self.scheduler.stats.late_replies += 1
            return
        step = rnd.step
        step.waiting.discard(worker)
        step.acks[worker] = p.WorkerAck(rnd.names[worker], ack.ok, ack.result, ack.message)
        if ack.ok and step.op == "commit":
            w = self.scheduler.workers.get(worker)
            if w is not None:
                w.weight_version = ack.weight_version
        self._maybe_done(rnd, now)

    def forget(self, worker: bytes, reason: str, now: float) -> None:
        """A member left (expired, evicted, disconnected): the round goes on without it."""
        rnd = self.round
        if rnd is None or worker not in rnd.members:
            return
        name = rnd.names[worker]
        del rnd.members[worker]
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
        sched = self.scheduler
        if step.op == "begin":  # a worker that could not pause takes no part in the round
            for identity in [i for i in rnd.members if i in step.acks and not step.acks[i].ok]:
                del rnd.members[identity]
                w = sched.workers.get(identity)
                if w is not None:
                    w.accepting = w.weight_version >= sched.fleet_version
        if rnd.lost:
            step.evicted[:0], rnd.lost = rnd.lost, []
        if step.op == "commit":
            versions = [a.result for a in step.acks.values() if a.ok and isinstance(a.result, int)]
            sched.fleet_version = max([sched.fleet_version, *versions])
        reply = p.SyncReply(rnd.round_id, step.op, list(step.acks.values()), step.evicted, sched.fleet_version)
        sched.outbox.to_client(rnd.client, p.SYNC_REPLY, reply)
        if step.op in ("commit", "abort"):
            self._end(rnd, now, f"{step.op} done")

    def _end(self, rnd: Round, now: float, why: str) -> None:
        self.round = None
        self.num_rounds += 1
        sched = self.scheduler
        for w in sched.workers.values():  # members, and any worker that joined during the round
            w.accepting = w.weight_version >= sched.fleet_version
        log.info("sync round %d ended (%s); fleet version %d", rnd.round_id, why, sched.fleet_version)
        sched.dispatch_soon(now)

    # -- time and loss ---------------------------------------------------------------------
    def tick(self, now: float) -> None:
        rnd = self.round
        if rnd is None:
            return
        step = rnd.step
        if step is not None and now > step.deadline:
            late = list(step.waiting)
            for identity in late:
                self.evict(identity, f"no answer to {step.op!r} within its timeout", now)
        elif step is None and now - rnd.last_activity > self.round_idle_timeout:
            self.abort(rnd, now, f"trainer silent for {self.round_idle_timeout} s (round_idle_timeout)")

    def evict(self, worker: bytes, reason: str, now: float) -> None:
        self.num_evicted += 1
        log.warning("evicting worker %r from the sync round: %s", worker, reason)
        self.scheduler.outbox.to_worker(worker, p.DISCONNECT, None)
        self.scheduler.worker_gone(worker, f"evicted: {reason}", now)

    def client_gone(self, client: bytes, now: float) -> None:
        rnd = self.round
        if rnd is not None and rnd.client == client:
            self.abort(rnd, now, "trainer disconnected")

    def abort(self, rnd: Round, now: float, why: str) -> None:
        """Resume every member with the weights it has; no reply (the trainer is gone)."""
        for identity in rnd.members:
            self.scheduler.outbox.to_worker(identity, p.CONTROL, p.Control(rnd.round_id, "resume", {}))
        self._end(rnd, now, f"aborted: {why}")
