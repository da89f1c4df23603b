"""The scheduler's side of what workers send back: results, partial results and errors.

Part of the pure ``Scheduler`` (``scheduler.py``): ``Results`` builds on ``Dispatch``
(``dispatch.py``; a finished job frees its worker's credits, a too stale one is queued again).
Each job gets exactly one FINAL or ERROR to its client: a result under a ticket that no
longer runs on *that* worker (requeued, cancelled, expired) is dropped and counted
(``late_replies``). A finished job's id is remembered while its client is young
(``ClientState.finished``), so that a resubmission after a broker restart is not run again.
Metrics are kept per message, not per job (``staleness.py``, ``state.tally_finished``).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from zmq_rollout import protocol as p

from .dispatch import Dispatch
from .staleness import observe_crossing, oldest_version
from .state import ClientId, ClientState, Job, Submission, WorkerId, WorkerState, tally_finished
from .sync import SyncCoordinator

AnyResult = p.ResultRelay | p.SealedResult | p.Result
"""A worker's result as the broker gets it: off the wire (FINAL, SEALED_FINAL) or built in Python."""

MAX_REMEMBERED = 100_000  # answered job ids kept per client for resubmissions (see ClientState.finished)


class Results(Dispatch):
    """Results, partial results and errors from workers, over the scheduler's state."""

    sync: SyncCoordinator

    def worker_seen(self, identity: WorkerId, now: float) -> WorkerState | None:
        """Refresh a worker's liveness; an unknown worker is told to reconnect fresh."""
        worker = self.workers.get(identity)
        if worker is None:
            self.outbox.to_worker(identity, p.DISCONNECT, None)
            self.stats.unknown_worker_messages += 1
            return None
        worker.last_seen = now
        return worker

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
        # Per client of this pass's results (dispatch gives a worker the clients' jobs in turn,
        # so the client changes from one result to the next): its state, its answered ids while
        # it is young (``_answered``) and its FINAL list, while nothing else goes to it
        # (``Outbox.finals``: anything else queued for the client drops its entry).
        parts: dict[ClientId, tuple[ClientState | None, list[str] | None, list[Any]]] = self.outbox.finals
        running_here, relay, sealed, spliced = worker.running, p.ResultRelay, p.SealedResult, p.SplicedFinal
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
            # Too stale, it is answered or queued again (an ERROR or ACCEPTED drops its client's part).
            if spec.max_staleness is not None and self._taken_too_stale(worker, job, result, fleet, now):
                continue
            cost = job.cost
            freed += cost  # ``worker.credits_used``, less, once after the loop
            jid = spec.job_id
            part = parts.get(job.client)
            if part is None:
                part = self._final_part(job.client, type(result) is sealed)
            client, remember, out = part
            if client is not None:
                client.jobs.pop(jid, None)
                if remember is not None and len(remember) < MAX_REMEMBERED:
                    remember.append(jid)
            if type(result) is relay:  # ``ResultRelay.to_client``, inline
                result.key = jid
                out.append(result)
            elif type(result) is sealed and type(out) is spliced:
                out.append((jid, result.result))  # ``SealedResult.to_client``, when written
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

    def _final_part(self, identity: ClientId, sealed: bool) -> tuple[ClientState | None, list[str] | None, list[Any]]:
        """What ``worker_final`` keeps per client of a pass's results: its state, its answered ids
        while it is young (``_answered``), and the FINAL list its results go into (for sealed
        results a ``SplicedFinal``: each spliced as it is written). Made once per client per
        outbox take, while that list stays the client's last message (``Outbox.keep_final``)."""
        client = self.clients.get(identity)
        remember = None if client is None or client.finished is None else client.finished.ids
        return self.outbox.keep_final(identity, (client, remember), sealed)

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
        if worker is not None:
            self.fail_tickets(worker, errors, now)

    def fail_tickets(self, worker: WorkerState, errors: list[p.ErrorItem], now: float) -> None:
        """End ``worker``'s tickets that ``errors`` name (``key``: the ticket) with those errors to
        their clients: the worker's own ERROR, or the broker's refusal of jobs it cannot send that
        worker (``older_workers.py``; the worker did not speak: its liveness is left as it was)."""
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
        if finished is not None and len(finished.ids) < MAX_REMEMBERED:
            finished.ids.append(job_id)

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
