"""The broker's Prometheus ``/metrics``: read from the scheduler at scrape time.

The scheduler keeps plain counters (``stats.BrokerStats``); this collector turns them and the
live queue/worker state into metric families when Prometheus scrapes, so the broker's hot
path never touches a Prometheus object. Own ``CollectorRegistry``; no job ids in labels.
Jobs and queues are here; each worker, sync rounds and staleness in ``fleet_metrics.py``.
Every family is listed in docs/metrics.md.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterator
from typing import Any

from prometheus_client import CollectorRegistry
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from zmq_rollout.metrics import start_metrics_server

from .fleet_metrics import histogram as _histogram
from .fleet_metrics import sync_families, worker_families
from .scheduler import Scheduler

log = logging.getLogger(__name__)

MALFORMED_REASONS = ("oversize", "invalid", "invalid_job", "worker", "unroutable")
"""The broker's reasons for refusing a message (docs/protocol.md, section 7), exported from 0."""

_COUNTERS = {
    "submitted": "Jobs accepted into a queue.",
    "completed": "Jobs whose final result reached their client.",
    "failed": "Jobs that ended in an error from a worker, or lost too many workers.",
    "cancelled": "Jobs cancelled by their client.",
    "requeued": "Jobs put back in the queue because their worker was lost.",
    "stale_restarted": "Jobs run again from the start: they finished more than their max_staleness versions behind.",
    "stale": "Jobs answered with a stale error (max_staleness; also counted as failed).",
    "rejected_busy": "Jobs refused with BUSY because a queue was full.",
    "rejected_invalid": "Jobs refused as invalid (duplicate id and the like).",
    "dropped_client_gone": "Jobs dropped because their client disconnected or expired.",
    "late_replies": "Worker replies for jobs no longer running there (dropped).",
    "workers_expired": "Workers purged after missing heartbeats.",
}


class SchedulerCollector:
    def __init__(self, scheduler: Scheduler, clock: Callable[[], float] = time.monotonic) -> None:
        self.scheduler = scheduler
        self.clock = clock
        """The scheduler's clock (the broker passes ``time.monotonic()`` as ``now``): heartbeat ages."""

    def collect(self) -> Iterator[Metric]:
        # The broker thread mutates these dicts while we read: copy first, retry on a race.
        for _ in range(5):
            try:
                return iter(list(self._collect()))
            except RuntimeError:
                continue
        return iter(())

    def _collect(self) -> Iterator[Metric]:
        s = self.scheduler
        stats = s.stats
        jobs = CounterMetricFamily("zmq_rollout_jobs", "Jobs by outcome.", labels=["outcome"])
        for field in _COUNTERS:
            jobs.add_metric([field], getattr(stats, field))
        yield jobs
        malformed = CounterMetricFamily(
            "zmq_rollout_malformed_messages", "Messages refused as malformed, by reason.", labels=["reason"]
        )
        counts = dict(stats.malformed)
        for reason in MALFORMED_REASONS:  # at 0 from the start: rate() and increase() see the first one
            counts.setdefault(reason, 0)
        for reason, count in counts.items():
            malformed.add_metric([reason], count)
        yield malformed
        auth = CounterMetricFamily(
            "zmq_rollout_auth_failures",
            "Failed CurveZMQ handshakes by port (frontend, backend) and reason (key_not_allowed, handshake).",
            labels=["port", "reason"],
        )
        for (port, reason), count in list(stats.auth_failures.items()):
            auth.add_metric([port, reason], count)
        yield auth
        yield CounterMetricFamily(
            "zmq_rollout_broker_busy_poll_seconds",
            "Seconds the broker polled without sleeping after busy passes (busy_poll_us): its CPU cost of latency.",
            value=stats.busy_poll_s,
        )
        yield GaugeMetricFamily(
            "zmq_rollout_broker_busy_ratio",
            "Share of the last review interval (0.25 s) the broker spent working (not waiting or busy polling).",
            value=stats.busy,
        )
        yield GaugeMetricFamily(
            "zmq_rollout_broker_packing",
            "1 while the broker is busy and packs jobs onto fewer workers (pack_step); 0: least loaded first.",
            value=int(stats.packing),
        )
        messages = CounterMetricFamily(
            "zmq_rollout_broker_messages",
            "Messages the broker read (received) and sent, to and from clients and workers: over jobs "
            "completed, what batching saves.",
            labels=["direction"],
        )
        messages.add_metric(["received"], stats.messages_received)
        messages.add_metric(["sent"], stats.messages_sent)
        yield messages
        yield GaugeMetricFamily(
            "zmq_rollout_broker_split_form_peers",
            "Clients and workers whose last message was in the split form (older than the packed form).",
            value=stats.split_peers,
        )
        yield _histogram("zmq_rollout_job_latency_seconds", "Submit to final result, per job.", stats.job_latency)
        yield _histogram("zmq_rollout_queue_wait_seconds", "Submit to dispatch, per job attempt.", stats.queue_wait)
        depth = GaugeMetricFamily("zmq_rollout_queue_depth", "Queued jobs per client.", labels=["client"])
        running = GaugeMetricFamily(
            "zmq_rollout_running_jobs", "Jobs running on workers per client.", labels=["client"]
        )
        for client in list(s.clients.values()):
            depth.add_metric([client.name], client.num_queued)
            running.add_metric([client.name], len(client.jobs) - client.num_queued)
        yield depth
        yield running
        workers = list(s.workers.values())
        states = {"ready": 0, "syncing": 0, "stale": 0}
        for w in workers:
            states[s.worker_state(w)] += 1
        by_state = GaugeMetricFamily("zmq_rollout_workers", "Registered workers by state.", labels=["state"])
        for state, count in states.items():
            by_state.add_metric([state], count)
        yield by_state
        yield GaugeMetricFamily(
            "zmq_rollout_credits", "Credits announced by all workers.", value=sum(w.credits for w in workers)
        )
        yield GaugeMetricFamily(
            "zmq_rollout_credits_free", "Credits not in use.", value=sum(max(0, w.credits_free) for w in workers)
        )
        yield GaugeMetricFamily("zmq_rollout_queued_jobs", "Queued jobs across clients.", value=s.num_queued)
        yield from session_families(s)
        yield from worker_families(s, self.clock())
        yield from sync_families(s)


def session_families(s: Scheduler) -> Iterator[Metric]:
    """Session affinity (``affinity.py``): where turns went, turns held, records kept."""
    stats = s.stats.sessions
    for name, doc, label, values in (
        (
            "zmq_rollout_session_dispatches",
            "Session turns dispatched, by outcome (affine: to the worker of the session's last turn; "
            "moved: to another; new: no record of the session).",
            "outcome",
            stats.dispatches,
        ),
        (
            "zmq_rollout_session_holds",
            "Session turns held for their full worker, by outcome (served: it had room within "
            "affinity_wait_s; released: they went to the least loaded).",
            "outcome",
            stats.holds,
        ),
        (
            "zmq_rollout_sessions_dropped",
            "Session records dropped, by reason (ended, idle, cap).",
            "reason",
            stats.dropped,
        ),
    ):
        family = CounterMetricFamily(name, doc, labels=[label])
        for value, count in list(values.items()):
            family.add_metric([value], count)
        yield family
    yield GaugeMetricFamily(
        "zmq_rollout_sessions", "Sessions remembered (with their last worker).", value=len(s.affinity.sessions)
    )
    yield GaugeMetricFamily(
        "zmq_rollout_held_jobs", "Session turns waiting for their worker now (queued jobs).", value=s.affinity.num_held
    )


def serve_metrics(scheduler: Scheduler, port: int, addr: str = "127.0.0.1") -> Any:
    registry = CollectorRegistry()
    registry.register(SchedulerCollector(scheduler))
    return start_metrics_server(registry, port, addr)
