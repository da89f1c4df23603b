"""The broker's logic: credits, fair per-client queues, dispatch, requeue, cancel, expiry.

A pure class: it takes events (a client submitted, a worker became ready, a result came
back, time passed) and writes the messages to send into an ``Outbox``. It never touches a
socket, so every rule here is unit-tested without one (tests/unit/test_scheduler.py).

One class in three modules, each building on the one before: ``dispatch.py`` (queues and
dispatch), ``results.py`` (what workers send back) and this one (clients and workers coming,
going and falling silent; status).

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

from zmq_rollout import protocol as p
from zmq_rollout.config import BrokerConfig

from .affinity import Affinity
from .dispatch_heap import DispatchHeap
from .outbox import Outbox
from .results import Results
from .state import AnsweredIds, ClientId, ClientState, Job, Submission, WorkerId, WorkerState, peer_name
from .stats import BrokerStats
from .sync import SyncCoordinator

log = logging.getLogger(__name__)


class Scheduler(Results):
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
            name = peer_name(identity)
            client = self.clients[identity] = ClientState(identity, name, now, since=now, finished=AnsweredIds())
            log.info("client %s connected", client.name)
        client.last_seen = now
        return client

    def client_seen(self, identity: ClientId, now: float) -> None:
        self._client(identity, now)

    def submit(self, identity: ClientId, jobs: Sequence[p.JobSpec | p.JobRelay | p.SealedJob], now: float) -> None:
        """Queue ``jobs`` (one message's) for ``identity``, answering each it refuses (a duplicate
        id, a full queue) and, where asked, ACCEPTED for the rest."""
        client = self._client(identity, now)
        accepted: list[str] = []
        new = 0
        cfg = self.config
        queue, jobs_here, submission = client.queue, client.jobs, Submission(now)
        idle = not queue and not self.affinity.holds(identity)  # not in ``_waiting``
        room = min(cfg.max_queue_per_client - client.num_queued, cfg.max_queue_total - self.num_queued)
        sealed_job = p.SealedJob  # its worker gets the job's bytes as they came (``Job.wire``)
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
                wire = spec.job if type(spec) is sealed_job else spec
                jobs_here[jid] = job = Job(identity, spec, submission, spec.cost(), wire)
                queue.append(job)
                if spec.ack:
                    accepted.append(jid)
                new += 1
        self.num_queued += new
        client.num_queued += new
        if idle and new:
            self._waiting.append(client)
        self.stats.submitted += new
        self.stats.submits += 1
        if accepted:
            self.outbox.to_client_many(identity, p.ACCEPTED, accepted)
        self.dispatch_soon(now)

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
        self.outbox.forget_final(identity)  # its state, kept with a FINAL list (``Results._final_part``)
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
        worker.checks_cost = p.SEALED_JOBS in info.capabilities
        self.dispatch_soon(now)

    def worker_credit(self, identity: WorkerId, credits: int, now: float) -> None:
        worker = self.worker_seen(identity, now)
        if worker is not None:
            worker.credits = max(0, credits)
            self._heap.invalidate()
            self.dispatch_soon(now)

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
                self.outbox.forget_final(client.identity)
        self.sync.tick(now)
        self._heap.invalidate()  # a safety net: whatever changed unseen is seen within a tick
        self.affinity.expire(now)
        self.stats.forget_gone_workers(now)
        quiet_since = now - cfg.heartbeat_interval_s
        for identity, worker in self.workers.items():
            if worker.jobs_sent_at <= quiet_since:
                self.outbox.to_worker(identity, p.HEARTBEAT, None)

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
