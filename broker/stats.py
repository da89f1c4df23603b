"""Counters and histograms the scheduler updates on its hot path.

Plain integers and a bisect histogram, with no Prometheus objects: the metrics module reads
them at scrape time (``zmq_rollout.broker.metrics``), so the hot path pays an integer add.
"""

from __future__ import annotations

from bisect import bisect_left
from dataclasses import dataclass, field

LATENCY_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300)


@dataclass
class Histogram:
    buckets: tuple[float, ...] = LATENCY_BUCKETS
    counts: list[int] = field(default_factory=list)
    total: float = 0.0
    count: int = 0

    def __post_init__(self) -> None:
        self.counts = [0] * (len(self.buckets) + 1)

    def observe(self, value: float) -> None:
        self.counts[bisect_left(self.buckets, value)] += 1
        self.total += value
        self.count += 1

    def cumulative(self) -> list[tuple[str, int]]:
        out, acc = [], 0
        for bound, n in zip((*map(str, self.buckets), "+Inf"), self.counts, strict=False):
            acc += n
            out.append((bound, acc))
        return out


@dataclass
class BrokerStats:
    submitted: int = 0
    completed: int = 0
    failed: int = 0
    cancelled: int = 0
    requeued: int = 0
    rejected_busy: int = 0
    rejected_invalid: int = 0
    dropped_client_gone: int = 0
    late_replies: int = 0
    unknown_worker_messages: int = 0
    workers_expired: int = 0
    malformed: dict[str, int] = field(default_factory=dict)  # by reason
    job_latency: Histogram = field(default_factory=Histogram)
    queue_wait: Histogram = field(default_factory=Histogram)

    def observe_done(self, seconds: float) -> None:
        self.job_latency.observe(seconds)

    def observe_queue_wait(self, seconds: float) -> None:
        self.queue_wait.observe(seconds)

    def count_malformed(self, reason: str) -> None:
        self.malformed[reason] = self.malformed.get(reason, 0) + 1
