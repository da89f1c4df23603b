"""The scheduler's queues and dispatch: which queued job goes to which worker, and when.

The first of the pure ``Scheduler``'s three layers: ``Results`` (``results.py``) builds on
this, and ``Scheduler`` (``scheduler.py``) on that. It holds no state of its own: the
attributes declared below are the scheduler's, set in ``Scheduler.__init__``.

Rules:
- fair sharing: the clients with queued jobs take turns, one job each (``_waiting``: their
  turn order); a job no worker can take yet keeps its client's place;
- credits: a job goes only to a worker that takes jobs (not syncing, not stale), has room for
  its cost (``sampling.n``; a job larger than a whole worker runs alone on an idle one) and
  at least its ``min_weight_version``; least loaded first, or packed in steps of credits
  while the broker is busy (``dispatch_heap.py``, ``packing.py``);
- a session's turn goes to its last worker, or waits for it (``affinity.py``);
- one dispatch per socket-loop pass (``defer_dispatch``), not one per event.
"""

from __future__ import annotations

import itertools
from collections import deque
from typing import Any

from zmq_rollout import protocol as p
from zmq_rollout.config import BrokerConfig

from .affinity import Affinity, Held, fits
from .dispatch_heap import DispatchHeap, Heap
from .outbox import WORKER, Outbox
from .state import ClientId, ClientState, Job, Submission, WorkerId, WorkerState, tally_taken
from .stats import BrokerStats


class Dispatch:
    """Queues and dispatch, over the scheduler's state (set in ``Scheduler.__init__``)."""

    config: BrokerConfig
    outbox: Outbox
    stats: BrokerStats
    clients: dict[ClientId, ClientState]
    workers: dict[WorkerId, WorkerState]
    affinity: Affinity
    num_queued: int
    """Jobs queued for all clients (``max_queue_total``)."""
    defer_dispatch: bool
    """The socket loop dispatches once per pass (``flush_dispatch``), not once per event."""
    dispatch_pending: bool
    _waiting: deque[ClientState]
    """Clients with queued or held jobs, in turn order."""
    _tickets: itertools.count[int]
    _heap: DispatchHeap
    """Workers that may take jobs, in dispatch order (``dispatch_heap.py``)."""

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

    @property
    def dispatch_step(self) -> int:
        """Dispatch's step: 1 least loaded first; more while the socket loop packs (``packing.py``)."""
        return self._heap.step

    def set_dispatch_step(self, step: int, blocks: bool = False) -> None:
        """Dispatch least loaded first (1) or packed in steps of ``step`` credits from now on;
        packed, with ``blocks``, a block of jobs to a worker at the start of a step rather than
        to one an earlier pass left part-filled (``dispatch_heap.py``)."""
        self._heap.set_step(step, blocks)

    def _offer(self, w: WorkerState) -> None:
        """``w``'s load changed: its new place on the dispatch heap, if it may take a job."""
        self._heap.offer(w, len(self.workers))

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
            client.num_queued -= 1
            ticket = job.ticket = next(tickets)
            job.dispatched_version = version
            running[ticket] = job
            cost = job.cost
            used += cost
            job.worker = identity
            out.append(relay(ticket, job.wire, cost))
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
            if heap and 2 * (used // step) > heap[0][0]:  # ``pick`` takes it again while it comes first (``entry``)
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
        out.append(p.AssignmentRelay(ticket, job.wire, job.cost))
        self._heap.offer_next(worker, len(self.workers))  # kept for the next pick (dispatch_heap.py)
        if spec.session_id is not None:
            self.affinity.dispatched(client.identity, job, identity, now)
