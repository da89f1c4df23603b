"""The broker's logic: credits, fair per-client queues, dispatch, requeue, cancel, expiry.

A pure class: it takes events (a client submitted, a worker became ready, a result came
back, time passed) and writes the messages to send into an ``Outbox``. It never touches a
socket, so every rule here is unit-tested without one (tests/unit/test_scheduler.py).

Invariants:
- a job is in exactly one place: its client's ``queue``, held for its session's worker
  (``affinity.py``; still queued in its client's ``jobs``) or one worker's ``running``;
- a worker never holds more credits of work than it announced, except that a job larger
  than all of a worker's credits may run alone on an idle worker;
- each job gets exactly one FINAL or ERROR to its client: results under a ticket that is
  no longer running on *that* worker (requeued, cancelled, expired) are dropped, and a job
  sent again after a restart (``resubmitted``) that this broker already answered is not
  run again (it remembers the jobs it answered in a client's first ``client_expiry_s``).
"""

from __future__ import annotations

import itertools
import logging
from collections import deque
from collections.abc import Sequence
from typing import Any

from zmq_rollout import protocol as p
from zmq_rollout.config import BrokerConfig

from .affinity import Affinity, Held, fits
from .dispatch_heap import DispatchHeap, Heap
from .outbox import CLIENT, WORKER, Outbox
from .staleness import observe_crossing, oldest_version
from .state import (
    ClientId,
    ClientState,
    Job,
    Submission,
    WorkerId,
    WorkerState,
    peer_name,
    tally_finished,
    tally_taken,
)
from .stats import BrokerStats
from .sync import SyncCoordinator

AnyResult = p.ResultRelay | p.SealedResult | p.Result
"""A worker's result as the broker gets it: off the wire (FINAL, SEALED_FINAL) or built in Python."""

log = logging.getLogger(__name__)

MAX_REMEMBERED = 100_000  # answered job ids kept per client for resubmissions (see ClientState.finished)


class Scheduler:
    def __init__(self, config: BrokerConfig | None = None, outbox: Outbox | None = None) -> None:
        self.config = config or BrokerConfig()
        self.outbox = outbox or Outbox()
        self.stats = BrokerStats()
        self.clients: dict[ClientId, ClientState] = {}
        self.workers: dict[WorkerId, WorkerState] = {}
        self._waiting: deque[ClientState] = deque()  # clients with queued or held jobs, in turn order
        self._tickets = itertools.count(1)
        self.num_queued = 0
        self.defer_dispatch = False
        self.dispatch_pending = False
        self.sync = SyncCoordinator(self, self.config.round_idle_timeout_s)
        self._heap = DispatchHeap()
        """Workers that may take jobs, in dispatch order (``dispatch_heap.py``)."""
        self.affinity = Affinity(self.config, self.stats.sessions)

    @property
    def fleet_version(self) -> int:
        """The newest weight version a sync round has committed."""
        return self.sync.fleet_version

    # -- clients ---------------------------------------------------------------------------
    def _client(self, identity: ClientId, now: float) -> ClientState:
        client = self.clients.get(identity)
        if client is None:
            client = self.clients[identity] = ClientState(identity, peer_name(identity), now, since=now, finished=set())
            log.info("client %s connected", client.name)
        client.last_seen = now
        return client

    def client_seen(self, identity: ClientId, now: float) -> None:
        self._client(identity, now)

    def submit(self, identity: ClientId, jobs: Sequence[p.JobSpec | p.JobRelay], now: float) -> None:
        client = self._client(identity, now)
        accepted: list[str] = []
        new = 0
        cfg = self.config
        queue, jobs_here, submission = client.queue, client.jobs, Submission(now)
        idle = not queue and not self.affinity.holds(identity)  # not in ``_waiting``
        room = min(cfg.max_queue_per_client - client.num_queued, cfg.max_queue_total - self.num_queued)
        for spec in jobs:
            jid = spec.job_id
            if spec.resubmitted and (jid in jobs_here or jid in (client.finished or ())):
                if spec.ack:  # sent again after a restart it did not see: it is (or was) here, once
                    accepted.append(jid)
            elif jid in jobs_here:
                self.outbox.to_client(
                    identity, p.ERROR, p.ErrorItem(jid, "invalid_request", f"job id {jid!r} is already in flight")
                )
                self.stats.rejected_invalid += 1
            elif new >= room:
                self.outbox.to_client(
                    identity,
                    p.BUSY,
                    p.ErrorItem(
                        jid,
                        "busy",
                        (
                            f"queue full ({client.num_queued} queued for this client, {self.num_queued + new} in all; "
                            "limits: max_queue_per_client / max_queue_total)"
                        ),
                    ),
                )
                self.stats.rejected_busy += 1
            else:  # queued (as ``_enqueue``, its turn in ``_waiting`` taken once below)
                jobs_here[jid] = job = Job(identity, spec, submission, spec.cost())
                queue.append(job)
                if spec.ack:
                    accepted.append(jid)
                new += 1
        self.num_queued += new
        client.num_queued += new
        if idle and new:
            self._waiting.append(client)
        self.stats.submitted += new
        if accepted:
            self.outbox.to_client_many(identity, p.ACCEPTED, accepted)
        self.dispatch_soon(now)

    def _enqueue(self, client: ClientState, job: Job, *, front: bool = False) -> None:
        """Queue again a job of ``client`` that ran (its worker was lost, or it ran again for
        staleness); it stays in the client's ``jobs``."""
        if not client.queue and not self.affinity.holds(client.identity):
            self._waiting.append(client)
        if front:
            client.queue.appendleft(job)
        else:
            client.queue.append(job)
        job.worker = b""
        client.num_queued += 1
        self.num_queued += 1

    def cancel(self, identity: ClientId, job_ids: list[str], now: float) -> None:
        client = self._client(identity, now)
        for jid in job_ids:
            if self._drop_job(client, jid):
                self.stats.cancelled += 1
                self.outbox.to_client(identity, p.ERROR, p.ErrorItem(jid, "cancelled", "cancelled by the client"))
        self.dispatch_soon(now)

    def _drop_job(self, client: ClientState, jid: str) -> bool:
        """Remove a job wherever it is; abort it on its worker. False if unknown."""
        job = client.jobs.pop(jid, None)
        if job is None:
            return False
        if not job.worker:  # queued
            job.cancelled = True  # lazily skipped by dispatch
            client.num_queued -= 1
            self.num_queued -= 1
            return True
        worker = self.workers.get(job.worker)
        if worker is not None:
            running = worker.running.pop(job.ticket, None)
            if running is not None:
                worker.credits_used -= running.cost
                self._offer(worker)
                self.outbox.to_worker(worker.identity, p.CANCEL, job.ticket)
        return True

    def client_gone(self, identity: ClientId, reason: str, now: float) -> None:
        client = self.clients.pop(identity, None)
        if client is None:
            return
        self.sync.client_gone(identity, now)
        dropped = list(client.jobs)
        for jid in dropped:
            self._drop_job(client, jid)
        client.queue.clear()
        self.affinity.client_gone(identity)
        if client in self._waiting:
            self._waiting.remove(client)
        self.stats.dropped_client_gone += len(dropped)
        log.info("client %s gone (%s): dropped %d jobs", client.name, reason, len(dropped))
        self.dispatch_soon(now)  # its credits are free for the others

    # -- workers ---------------------------------------------------------------------------
    def workers_changed(self) -> None:
        """Which workers may take jobs, or their credits, changed: rebuild the dispatch heap."""
        self._heap.invalidate()

    @property
    def dispatch_step(self) -> int:
        """Dispatch's step: 1 least loaded first; more while the socket loop packs (``packing.py``)."""
        return self._heap.step

    def set_dispatch_step(self, step: int) -> None:
        """Dispatch least loaded first (1) or packed in steps of ``step`` credits from now on."""
        self._heap.set_step(step)

    def _offer(self, w: WorkerState) -> None:
        """``w``'s load changed: its new place on the dispatch heap, if it may take a job."""
        self._heap.offer(w, len(self.workers))

    def worker_ready(self, identity: WorkerId, info: p.WorkerInfo, now: float) -> None:
        self._heap.invalidate()
        worker = self.workers.get(identity)
        if worker is None:
            worker = self.workers[identity] = WorkerState(
                identity, info, now, info.credits, weight_version=info.weight_version
            )
            # A late joiner gets no jobs until a round brings it to the fleet's version.
            worker.accepting = self.sync.is_current(worker)
            self.stats.worker_joined(info.name)
            log.info(
                "worker %s joined: model=%s credits=%d version=%d",
                info.name,
                info.model,
                info.credits,
                info.weight_version,
            )
        else:
            if info.name != worker.info.name:
                self.stats.worker_renamed(worker.info.name, info.name, now)
            worker.info, worker.credits, worker.weight_version = info, info.credits, info.weight_version
        worker.last_seen = now
        worker.reads_token_bins = p.TOKEN_BINS in info.capabilities
        self.dispatch_soon(now)

    def worker_seen(self, identity: WorkerId, now: float) -> WorkerState | None:
        """Refresh a worker's liveness; an unknown worker is told to reconnect fresh."""
        worker = self.workers.get(identity)
        if worker is None:
            self.outbox.to_worker(identity, p.DISCONNECT, None)
            self.stats.unknown_worker_messages += 1
            return None
        worker.last_seen = now
        return worker

    def worker_credit(self, identity: WorkerId, credits: int, now: float) -> None:
        worker = self.worker_seen(identity, now)
        if worker is not None:
            worker.credits = max(0, credits)
            self._heap.invalidate()
            self.dispatch_soon(now)

    def worker_partial(self, identity: WorkerId, deltas: list[p.DeltaRelay], now: float) -> None:
        worker = self.worker_seen(identity, now)
        if worker is None:
            return
        for delta in deltas:
            job = worker.running.get(delta.key)  # type: ignore[arg-type]
            if job is None:
                self.stats.late_replies += 1
                continue
            delta.key = job.spec.job_id
            self.outbox.to_client(job.client, p.PARTIAL, delta)

    def worker_final(self, identity: WorkerId, results: Sequence[AnyResult], now: float) -> None:
        worker = self.worker_seen(identity, now)
        if worker is None:
            return
        fleet = self.sync.fleet_version
        # Per client of this message's results (dispatch gives a worker the clients' jobs in
        # turn, so the client changes from one result to the next): its state, its answered ids
        # while it is young (``_answered``) and its FINAL list, while nothing else goes to it.
        parts: dict[ClientId, tuple[ClientState | None, set[str] | None, list[Any]]] = {}
        running_here, clients, outbox, relay = worker.running, self.clients, self.outbox, p.ResultRelay
        # The metrics per block (``staleness.py``): each submission's latency once (``tally``);
        # samples of the fleet's version counted at once; a result that crossed a sync, alone.
        finished: list[Submission] = []
        fresh = done = freed = 0
        for result in results:
            ticket: Any = result.key
            job = running_here.pop(ticket, None)  # ``_finish``, inline for the usual case
            if job is None:
                self.stats.late_replies += 1
                continue
            spec = job.spec
            if spec.max_staleness is not None:
                parts.clear()  # it may send an ERROR or ACCEPTED: later FINALs go after it
                if self._taken_too_stale(worker, job, result, fleet, now):
                    continue
            cost = job.cost
            freed += cost  # ``worker.credits_used``, less, once after the loop
            jid = spec.job_id
            part = parts.get(job.client)
            if part is None:
                client = clients.get(job.client)
                remember = None if client is None else client.finished
                part = parts[job.client] = (client, remember, outbox.items_to(CLIENT, job.client, p.FINAL))
            client, remember, out = part
            if client is not None:
                client.jobs.pop(jid, None)
                if remember is not None and len(remember) < MAX_REMEMBERED:
                    remember.add(jid)
            if type(result) is relay:  # ``ResultRelay.to_client``, inline
                result.key = jid
                out.append(result)
            else:
                out.append(result.to_client(jid))
            sub = job.submission
            if sub.finished:
                sub.finished += 1
            else:
                sub.finished = 1
                finished.append(sub)
            if result.weight_version == job.dispatched_version >= fleet:  # the usual: the fleet's version
                fresh += cost
            else:
                self._observe_version(job, result, fleet)
            done += 1
        if done:
            worker.credits_used -= freed
            self._done(worker, done, finished, fresh, now)
        self.dispatch_soon(now)

    def _observe_version(self, job: Job, result: AnyResult, fleet: int) -> None:
        """The staleness of a finished job's samples not all of the fleet's version: ``n`` of
        the version it was dispatched at, unless a sync came meanwhile (``staleness.py``)."""
        version = result.weight_version
        if version != job.dispatched_version:
            observe_crossing(self.stats, result.samples, job.cost, version, fleet)
        else:
            self.stats.staleness.observe_many(fleet - version, job.cost)

    def _done(self, worker: WorkerState, done: int, finished: list[Submission], fresh: int, now: float) -> None:
        """After one FINAL: ``worker``'s place on the dispatch heap for its new load, once, and the
        metrics per block: ``done`` jobs finished, of ``finished`` submissions (one latency each,
        ``tally_finished``), ``fresh`` samples of the fleet's version."""
        self._offer(worker)
        stats = self.stats
        if fresh:
            stats.staleness.observe_many(0, fresh)
        tally_finished(finished, now, stats.job_latency)
        stats.completed += done
        tally = stats.workers.get(worker.info.name)
        if tally is not None:
            tally.completed += done

    def _taken_too_stale(self, worker: WorkerState, job: Job, result: AnyResult, fleet: int, now: float) -> bool:
        """``_too_stale`` for a job ``worker_final`` took off ``worker.running``: back there while
        it is judged, gone again if its result goes on."""
        worker.running[job.ticket] = job
        if self._too_stale(worker, job, result, fleet, now):
            return True
        del worker.running[job.ticket]
        return False

    def _too_stale(self, worker: WorkerState, job: Job, result: AnyResult, fleet: int, now: float) -> bool:
        """A result further behind the fleet than its job's ``max_staleness``: the job runs again
        (``on_stale="restart"``, while restarts are left) or is answered ``stale``. False: fresh
        enough, the result goes on as usual."""
        spec = job.spec
        limit = spec.max_staleness
        assert limit is not None
        if fleet - job.dispatched_version <= limit:
            return False  # no token is older than the worker's version at dispatch
        oldest = job.dispatched_version
        if result.weight_version != job.dispatched_version:
            oldest = oldest_version(result.samples, job.dispatched_version)
        behind = fleet - oldest
        if behind <= limit:
            return False
        client = self.clients.get(job.client)
        if client is not None and spec.on_stale == "restart" and job.restarts < self.config.max_stale_restarts:
            del worker.running[job.ticket]
            worker.credits_used -= job.cost
            self._offer(worker)
            job.restarts += 1
            self._enqueue(client, job, front=True)
            self.stats.stale_restarted += 1
            if spec.stream:  # the client drops the tokens streamed so far (StreamRestarted)
                self.outbox.to_client(job.client, p.ACCEPTED, spec.job_id)
            self.dispatch_soon(now)
            return True
        self._finish(worker, job.ticket)
        restarts = f" after {job.restarts} restarts (max_stale_restarts)" if job.restarts else ""
        message = (
            f"the job's oldest token is {behind} weight versions behind the fleet (version {oldest}, "
            f"fleet {fleet}); its max_staleness is {limit}{restarts}"
        )
        self.outbox.to_client(job.client, p.ERROR, p.ErrorItem(spec.job_id, "stale", message))
        self.stats.failed += 1
        self.stats.stale += 1
        return True

    def worker_error(self, identity: WorkerId, errors: list[p.ErrorItem], now: float) -> None:
        worker = self.worker_seen(identity, now)
        if worker is None:
            return
        for err in errors:
            job = self._finish(worker, err.key)
            if job is None:
                continue
            self.outbox.to_client(job.client, p.ERROR, p.ErrorItem(job.spec.job_id, err.code, err.message))
            self.stats.failed += 1
        self.dispatch_soon(now)

    @staticmethod
    def _answered(client: ClientState, job_id: str) -> None:
        """Remember an answered job while its client's session is young (``ClientState.finished``)."""
        finished = client.finished
        if finished is not None and len(finished) < MAX_REMEMBERED:
            finished.add(job_id)

    def _finish(self, worker: WorkerState, ticket: object, *, offer: bool = True) -> Job | None:
        """The job ``worker`` ran under ``ticket`` is over (None: no such job there any more).
        ``offer=False``: the caller puts the worker back on the dispatch heap (``_offer``)."""
        job = worker.running.pop(ticket, None)  # type: ignore[call-overload]
        if job is None:
            self.stats.late_replies += 1
            return None
        worker.credits_used -= job.cost
        if offer:
            self._offer(worker)
        client = self.clients.get(job.client)
        if client is not None:
            client.jobs.pop(job.spec.job_id, None)
            self._answered(client, job.spec.job_id)
        return job

    def worker_gone(self, identity: WorkerId, reason: str, now: float) -> None:
        """Purge a worker and requeue its jobs at the front of their clients' queues."""
        worker = self.workers.pop(identity, None)
        if worker is None:
            return
        self._heap.invalidate()
        self.sync.forget(identity, reason, now)
        self._unhold(self.affinity.worker_gone(identity))  # its sessions' turns go anywhere
        requeued = failed = 0
        for job in reversed(list(worker.running.values())):
            client = self.clients.get(job.client)
            if client is None or client.jobs.get(job.spec.job_id) is not job:
                continue
            job.losses += 1
            if job.losses >= self.config.max_attempts:
                del client.jobs[job.spec.job_id]
                failed += 1
                self._answered(client, job.spec.job_id)
                self.outbox.to_client(
                    job.client,
                    p.ERROR,
                    p.ErrorItem(
                        job.spec.job_id,
                        "job_failed",
                        f"job lost with {job.losses} workers in a row (last: {worker.info.name}, {reason}); "
                        "limit: max_attempts",
                    ),
                )
                continue
            self._enqueue(client, job, front=True)
            if job.spec.stream:  # the client drops the tokens streamed so far (StreamRestarted)
                self.outbox.to_client(job.client, p.ACCEPTED, job.spec.job_id)
            requeued += 1
        self.stats.requeued += requeued
        self.stats.failed += failed
        self.stats.worker_lost(worker.info.name, reason, requeued, now)
        log.info("worker %s gone (%s): %d jobs requeued, %d failed", worker.info.name, reason, requeued, failed)
        self.dispatch_soon(now)

    # -- time ------------------------------------------------------------------------------
    def excuse(self, seconds: float) -> None:
        """The broker itself got no CPU for ``seconds``: what its peers sent meanwhile is not
        read yet, so that time does not count as their silence."""
        for worker in self.workers.values():
            worker.last_seen += seconds
        for client in self.clients.values():
            client.last_seen += seconds

    def tick(self, now: float) -> None:
        """Expire silent workers and clients; send a HEARTBEAT to each worker sent no jobs
        within the last heartbeat interval (the others heard from the broker meanwhile: a
        worker takes any message as the broker's word, so under load 1,024 workers cost no
        1,024 heartbeats a second). With ``tick`` once per interval, a worker hears from the
        broker at least every two intervals (2 s), well within its ``broker_expiry_s`` (5 s)."""
        cfg = self.config
        for identity in [w for w, s in self.workers.items() if now - s.last_seen > cfg.worker_expiry_s]:
            self.stats.workers_expired += 1
            self.outbox.to_worker(identity, p.DISCONNECT, None)
            self.worker_gone(identity, "heartbeat expired", now)
        for identity in [c for c, s in self.clients.items() if now - s.last_seen > cfg.client_expiry_s]:
            self.client_gone(identity, "heartbeat expired", now)
        for client in self.clients.values():
            if client.finished is not None and now - client.since > cfg.client_expiry_s:
                client.finished = None  # past the time a resubmission comes in
        self.sync.tick(now)
        self._heap.invalidate()  # a safety net: whatever changed unseen is seen within a tick
        self.affinity.expire(now)
        self.stats.forget_gone_workers(now)
        quiet_since = now - cfg.heartbeat_interval_s
        for identity, worker in self.workers.items():
            if worker.jobs_sent_at <= quiet_since:
                self.outbox.to_worker(identity, p.HEARTBEAT, None)

    # -- dispatch --------------------------------------------------------------------------
    def dispatch_soon(self, now: float) -> None:
        """Dispatch now, or, when the socket loop batches (``defer_dispatch``), once at the
        end of its pass: one pass per loop iteration instead of one per message."""
        if self.defer_dispatch:
            self.dispatch_pending = True
        else:
            self.dispatch(now)

    def flush_dispatch(self, now: float) -> None:
        if self.dispatch_pending:
            self.dispatch_pending = False
            self.dispatch(now)

    def wake_at(self) -> float | None:
        """When a held turn stops waiting for its worker (the socket loop polls no longer)."""
        return self.affinity.next_deadline()

    def wake(self, now: float) -> None:
        """Dispatch if a held turn's wait is over."""
        at = self.affinity.next_deadline()
        if at is not None and at <= now:
            self.dispatch_soon(now)

    def _unhold(self, released: list[Held]) -> None:
        """Put released turns back at the front of their clients' queues, in order."""
        for entry in reversed(released):
            client = self.clients.get(entry.client)
            if client is not None:
                client.queue.appendleft(entry.job)  # still queued in ``jobs``; the client is waiting

    def dispatch(self, now: float) -> None:
        """Hand queued jobs to workers with free credits: least loaded worker first, one job
        per client in turn (fair sharing), never to a worker older than a job's
        ``min_weight_version``. A session's turn goes to its last worker if that has room, or
        waits for it (``affinity.py``) while its client's later jobs go on."""
        self._unhold(self.affinity.release_due(now))
        if not self._waiting:
            return
        dispatch_heap = self._heap
        heap = dispatch_heap.current(self.workers.values())
        blocked: list[ClientState] = []
        waiting = self._waiting
        held = self.affinity.held_clients
        pick = dispatch_heap.pick
        jobs_to: dict[WorkerId, list[p.AssignmentRelay]] = {}  # this pass's JOBS, per worker
        taken: list[Submission] = []  # the submissions of the jobs this pass took (one queue wait each)
        while waiting and (heap or dispatch_heap.kept):
            client = waiting.popleft()
            queue = client.queue
            head = queue[0] if queue else None
            if head is None or head.cancelled or head.spec.session_id is not None or client.identity in held:
                dispatch_heap.settle()  # what follows reads the heap whole
                found = self._next(client, heap, now)  # sessions, held turns, cancelled jobs
                if found is None:
                    if client.queue or client.identity in held:
                        blocked.append(client)  # no eligible worker now; keep its place for later
                    continue
                job, worker = found
            else:  # the usual turn: its head job to the first worker in order that takes it
                found_worker = pick(heap, head)
                if found_worker is None:
                    blocked.append(client)
                    continue
                if heap and dispatch_heap.step == 1:  # least loaded first: the next job likely goes elsewhere
                    job, worker = self._dequeue(client, queue.popleft()), found_worker
                else:  # packing, or the only worker: a run of jobs for it
                    self._run(found_worker, client, heap, now, jobs_to, taken)
                    continue
            self._assign(worker, client, job, now, jobs_to)  # its new entry is kept for the next pick
            sub = job.submission
            if sub.taken:
                sub.taken += 1
            else:
                sub.taken = 1
                taken.append(sub)
            if client.queue or client.identity in held:
                waiting.append(client)
        dispatch_heap.settle()
        waiting.extendleft(reversed(blocked))
        tally_taken(taken, now, self.stats.queue_wait)

    def _run(
        self,
        worker: WorkerState,
        client: ClientState,
        heap: Heap,
        now: float,
        jobs_to: dict[WorkerId, list[Any]],
        taken: list[Submission],
    ) -> None:
        """Give ``worker`` ``client``'s head job, then the next waiting clients' heads in turn
        for as long as ``pick`` would pick ``worker`` again for them: it still comes first in
        the heap's order (``dispatch_heap.entry``) and takes the job. The same assignments as
        one ``pick`` per job, without a pick and a new heap entry per job: while the broker
        packs, a worker takes a step's worth of jobs in one run. A turn that needs more (a
        session, a held turn, a cancelled head) or a job this worker cannot take ends the run;
        ``dispatch`` goes on with ``pick``. Packed order (its last pick wins a tie), or least
        loaded first with no other worker on the heap."""
        waiting, held, tickets = self._waiting, self.affinity.held_clients, self._tickets
        step, credits, version = self._heap.step, worker.credits, worker.weight_version
        assert step > 1 or not heap, "least loaded first: a run only for the only worker"
        identity, running = worker.identity, worker.running
        out = jobs_to.get(identity)
        if out is None:
            out = jobs_to[identity] = self.outbox.items_to(WORKER, identity, p.JOBS)
            worker.jobs_sent_at = now
        relay = p.AssignmentRelay
        used, first = worker.credits_used, len(out)
        queue = client.queue
        while True:  # each job as ``_dequeue`` and ``_assign`` do it, inline
            job = queue.popleft()
            spec = job.spec
            client.num_queued -= 1
            ticket = job.ticket = next(tickets)
            job.dispatched_version = version
            running[ticket] = job
            used += job.cost
            job.worker = identity
            out.append(relay(ticket, spec))
            sub = job.submission
            if sub.taken:
                sub.taken += 1
            else:
                sub.taken = 1
                taken.append(sub)
            if queue:
                waiting.append(client)
            if used >= credits or not waiting:
                break
            if heap and used // step > heap[0][0]:  # ``pick`` takes it again while it comes first
                break
            client = waiting[0]
            queue = client.queue
            if not queue:
                break
            head = queue[0]
            spec = head.spec
            if (
                head.cancelled
                or spec.session_id is not None
                or client.identity in held
                or head.cost > credits - used
                or spec.min_weight_version > version
            ):
                break
            waiting.popleft()
        worker.credits_used, worker.last_pick = used, ticket
        self.num_queued -= len(out) - first
        self._heap.offer_next(worker, len(self.workers))  # kept for the next pick (dispatch_heap.py)

    def _next(self, client: ClientState, heap: Heap, now: float) -> tuple[Job, WorkerState] | None:
        """The job ``client`` sends in its turn and its worker: a held turn whose worker has
        room, else its queue's head (to its session's worker if that has room; held if that
        is full; else to the least loaded on ``heap``)."""
        aff, cid = self.affinity, client.identity
        if aff.holds(cid):
            entry = aff.ready(cid, heap)
            if entry is not None:
                return self._dequeue(client, aff.take(entry)), self.workers[entry.worker]
        while (job := self._head(client)) is not None:
            target = None if job.spec.session_id is None else aff.target(cid, job, self.workers)
            if target is not None:
                if fits(target, job):
                    return self._dequeue(client, client.queue.popleft()), target
                if aff.hold(cid, job, target.identity, now):
                    client.queue.popleft()
                    continue
            worker = self._heap.pick(heap, job)
            if worker is None:
                return None
            return self._dequeue(client, client.queue.popleft()), worker
        return None

    def _dequeue(self, client: ClientState, job: Job) -> Job:
        client.num_queued -= 1
        self.num_queued -= 1
        return job

    @staticmethod
    def _head(client: ClientState) -> Job | None:
        queue = client.queue
        while queue and queue[0].cancelled:
            queue.popleft()
        return queue[0] if queue else None

    def _assign(
        self, worker: WorkerState, client: ClientState, job: Job, now: float, jobs_to: dict[WorkerId, list[Any]]
    ) -> None:
        """``job`` runs on ``worker``; its assignment joins ``jobs_to`` (this pass's JOBS lists).
        Its queue wait is the caller's to observe."""
        ticket = job.ticket = worker.last_pick = next(self._tickets)
        spec = job.spec
        job.dispatched_version = worker.weight_version
        worker.running[ticket] = job
        worker.credits_used += job.cost
        identity = worker.identity
        job.worker = identity
        out = jobs_to.get(identity)
        if out is None:
            out = jobs_to[identity] = self.outbox.items_to(WORKER, identity, p.JOBS)
            worker.jobs_sent_at = now
        out.append(p.AssignmentRelay(ticket, spec))
        self._heap.offer_next(worker, len(self.workers))  # kept for the next pick (dispatch_heap.py)
        if spec.session_id is not None:
            self.affinity.dispatched(client.identity, job, identity, now)

    # -- status ----------------------------------------------------------------------------
    def worker_state(self, w: WorkerState) -> str:
        if self.sync.holds(w.identity):
            return "syncing"
        return "ready" if self.sync.is_current(w) else "stale"

    def status(self, now: float) -> p.StatusReply:
        workers = [
            p.WorkerStatus(
                w.info.name,
                self.worker_state(w),
                w.info.model,
                w.credits,
                len(w.running),
                w.weight_version,
                round(now - w.last_seen, 3),
                list(w.info.capabilities),
                w.info.max_model_len,
                w.info.num_ranks,
            )
            for w in self.workers.values()
        ]
        clients = [p.ClientStatus(c.name, c.num_queued, len(c.jobs) - c.num_queued) for c in self.clients.values()]
        running = sum(len(w.running) for w in self.workers.values())
        st = self.stats
        totals = p.JobTotals(st.submitted, st.completed, st.failed, st.cancelled, st.requeued)
        return p.StatusReply(workers, clients, self.num_queued, running, self.fleet_version, totals)
