"""Metric families of the fleet as the broker sees it: each worker, weight-sync rounds,
weight versions and staleness. Built at scrape time from the scheduler's plain counters
(``stats.py``); ``metrics.py`` serves them with the rest.

Per-worker series are labelled by the worker's *name* (bounded by the fleet; two
connections under one name, a reconnect overlapping its purge, are summed). Its gauges end
with its last connection; its counters live on for ``GONE_WORKER_RETENTION_S``.
"""

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, Metric

from .scheduler import Scheduler
from .state import WorkerState
from .stats import Histogram


def histogram(name: str, doc: str, hist: Histogram) -> HistogramMetricFamily:
    return HistogramMetricFamily(name, doc, buckets=hist.cumulative(), sum_value=hist.total)


def _counter(name: str, doc: str, label: str, values: dict[str, int]) -> CounterMetricFamily:
    family = CounterMetricFamily(name, doc, labels=[label])
    for value, count in list(values.items()):
        family.add_metric([value], count)
    return family


def worker_families(s: Scheduler, now: float) -> Iterator[Metric]:
    """Credits, heartbeat age and version of each registered worker; its counters."""
    by_name: dict[str, list[WorkerState]] = {}
    for w in list(s.workers.values()):
        by_name.setdefault(w.info.name, []).append(w)
    for field, doc, value in (
        ("credits", "Credits the worker announced (its engine's max_num_seqs).", lambda w: w.credits),
        ("credits_used", "Credits its running jobs take.", lambda w: w.credits_used),
        ("credits_free", "Credits it has free for jobs.", lambda w: max(0, w.credits_free)),
    ):
        family = GaugeMetricFamily(f"zmq_rollout_worker_{field}", doc, labels=["worker"])
        for name, ws in by_name.items():
            family.add_metric([name], sum(value(w) for w in ws))
        yield family
    age = GaugeMetricFamily(
        "zmq_rollout_worker_heartbeat_age_seconds",
        "Seconds since the broker last heard from the worker.",
        labels=["worker"],
    )
    version = GaugeMetricFamily(
        "zmq_rollout_worker_weight_version", "The weight version the worker holds.", labels=["worker"]
    )
    for name, ws in by_name.items():
        age.add_metric([name], max(0.0, min(now - w.last_seen for w in ws)))
        version.add_metric([name], max(w.weight_version for w in ws))
    yield age
    yield version
    tallies = list(s.stats.workers.items())
    for field, attr, doc in (
        ("joins", "joins", "Times a worker of this name registered (each connection; a flapping worker joins often)."),
        ("completed_jobs", "completed", "Jobs whose result came from this worker."),
        ("requeued_jobs", "requeued", "Jobs requeued because a connection of this worker was lost."),
    ):
        yield _counter(f"zmq_rollout_worker_{field}", doc, "worker", {n: getattr(t, attr) for n, t in tallies})
    yield _counter(
        "zmq_rollout_workers_lost",
        "Workers purged, by reason (expired, evicted, disconnected, unroutable, other).",
        "reason",
        s.stats.workers_lost,
    )


def sync_families(s: Scheduler) -> Iterator[Metric]:
    """Weight-sync rounds and steps, versions, and the staleness of completed samples."""
    sync = s.stats.sync
    yield _counter(
        "zmq_rollout_sync_rounds",
        "Weight-sync rounds ended, by outcome (committed, failed, aborted, trainer_lost).",
        "outcome",
        sync.rounds,
    )
    yield GaugeMetricFamily(
        "zmq_rollout_sync_rounds_in_progress",
        "Weight-sync rounds running now (0 or 1).",
        value=int(s.sync.round is not None),
    )
    yield histogram("zmq_rollout_sync_round_duration_seconds", "A round's begin to its end.", sync.round_seconds)
    steps = HistogramMetricFamily(
        "zmq_rollout_sync_step_duration_seconds",
        "A step's CONTROL to its SYNC_REPLY (every member answered or was evicted), by step.",
        labels=["step"],
    )
    for step, hist in list(sync.step_seconds.items()):
        steps.add_metric([step], hist.cumulative(), hist.total)
    yield steps
    yield _counter(
        "zmq_rollout_sync_step_failures",
        "Members that answered a step with ok=false, by step.",
        "step",
        {step: sync.step_failures.get(step, 0) for step in [*sync.step_seconds, *sync.step_failures]},
    )  # at 0 from a step's first run: rate() and increase() see its first failure
    yield _counter(
        "zmq_rollout_sync_bytes",
        "Weight bytes loaded by workers, as the steps' buckets say (bucket bytes x members that loaded it), by step.",
        "step",
        sync.bytes,
    )
    yield _counter(
        "zmq_rollout_sync_evictions",
        "Members lost during a round, by reason (evicted: missed a step's deadline; expired, disconnected, ...).",
        "reason",
        sync.evictions,
    )
    yield GaugeMetricFamily(
        "zmq_rollout_fleet_weight_version",
        "The newest weight version a round committed (0 after a broker start).",
        value=s.fleet_version,
    )
    yield histogram(
        "zmq_rollout_sample_staleness_versions",
        "Per completed sample: the fleet's weight version minus the sample's (its oldest token's).",
        s.stats.staleness,
    )
    yield histogram(
        "zmq_rollout_sample_span_versions",
        "Per completed sample that crossed a sync (per-token versions): its newest token's version minus its oldest.",
        s.stats.version_span,
    )
