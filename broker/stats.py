"""Counters and histograms the scheduler updates on its hot path.

Plain integers and a bisect histogram, with no Prometheus objects: the metrics modules read
them at scrape time (``zmq_rollout.broker.metrics``, ``fleet_metrics``), so the hot path pays
an integer add. Every label value here comes from a fixed set (outcomes, reasons, step
names) or is a worker's name (bounded by the fleet); never a job id. docs/metrics.md lists
what each becomes.
"""

from __future__ import annotations

from bisect import bisect_left
from dataclasses import dataclass, field

LATENCY_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300)
VERSION_BUCKETS = (0, 1, 2, 3, 4, 6, 8, 12, 16, 32, 64)
"""Weight versions (staleness, spans): 0 is its own bucket, the common case."""

ROUND_OUTCOMES = ("committed", "failed", "aborted", "trainer_lost")
"""How a sync round ends: ``commit`` answered ok by every member that answered (at least
one); ``commit`` with a failure or no answer; the trainer's ``abort``; aborted by the broker
because the trainer disconnected, expired or went silent (``round_idle_timeout_s``)."""
LOSS_REASONS = ("expired", "evicted", "disconnected", "unroutable", "other")
"""Why a worker was purged: heartbeats stopped; a sync step's deadline passed; it said
DISCONNECT; a send to it failed; anything else."""
SESSION_OUTCOMES = ("affine", "moved", "new")
"""Where a session's turn went: the worker of its last turn; another (that worker was gone,
or full past ``affinity_wait_s``, or the turn was requeued); its first turn (or no record:
ended, idle, dropped over ``max_sessions``)."""
HOLD_OUTCOMES = ("served", "released")
"""A turn held for its full worker: got it within ``affinity_wait_s``; went to the least
loaded after that wait, or when its worker was purged."""
SESSION_DROPS = ("ended", "idle", "cap")
"""Why a session's record went: a turn said ``session_end``; ``session_idle_s`` without a
turn; the oldest, to keep ``max_sessions``."""
GONE_WORKER_RETENTION_S = 900.0
"""A worker name's counters outlive its last connection by this long, so that the requeues
its loss caused and a flapping worker's joins can be seen (and alerted on); then they go."""


def loss_reason(reason: str) -> str:
    """The ``LOSS_REASONS`` label of a ``worker_gone`` reason."""
    if reason == "heartbeat expired":
        return "expired"
    if reason.startswith("evicted"):
        return "evicted"
    if reason == "worker left":
        return "disconnected"
    return "unroutable" if reason.startswith("unroutable") else "other"


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

    def observe_many(self, value: float, times: int) -> None:
        """``times`` observations of ``value`` (the samples of one result)."""
        self.counts[bisect_left(self.buckets, value)] += times
        self.total += value * times
        self.count += times

    def cumulative(self) -> list[tuple[str, int]]:
        """(le, count) per bucket; ``le`` as prometheus_client writes it (``1.0``, not ``1``),
        which is also how Prometheus 3 stores it, so one ``le="1.0"`` matches everywhere."""
        out, acc = [], 0
        bounds = [repr(float(b)) for b in self.buckets]
        for bound, n in zip((*bounds, "+Inf"), self.counts, strict=False):
            acc += n
            out.append((bound, acc))
        return out


@dataclass
class WorkerTally:
    """Counters of one worker *name*, kept across its connections (each reconnect is a new
    identity) and for ``GONE_WORKER_RETENTION_S`` after the last one ends."""

    joins: int = 0
    completed: int = 0
    requeued: int = 0
    """Jobs requeued because a connection of this worker was lost."""
    live: int = 0
    """Its connections registered now (two while a reconnect overlaps the old one's purge)."""
    gone_since: float | None = None


def _zeros(labels: tuple[str, ...]) -> dict[str, int]:
    return dict.fromkeys(labels, 0)


@dataclass
class SyncStats:
    """Weight-sync rounds, updated once per step and per round (``broker/sync.py``)."""

    rounds: dict[str, int] = field(default_factory=lambda: _zeros(ROUND_OUTCOMES))
    round_seconds: Histogram = field(default_factory=Histogram)
    step_seconds: dict[str, Histogram] = field(default_factory=dict)  # by step name
    step_failures: dict[str, int] = field(default_factory=dict)  # members answering not ok, by step
    bytes: dict[str, int] = field(default_factory=dict)  # bucket bytes loaded, by step
    evictions: dict[str, int] = field(default_factory=lambda: _zeros(LOSS_REASONS))

    def step_done(self, step: str, seconds: float, num_ok: int, num_failed: int, nbytes: int) -> None:
        hist = self.step_seconds.get(step)
        if hist is None:
            hist = self.step_seconds[step] = Histogram()
        hist.observe(seconds)
        if num_failed:
            self.step_failures[step] = self.step_failures.get(step, 0) + num_failed
        if nbytes and num_ok:
            self.bytes[step] = self.bytes.get(step, 0) + nbytes * num_ok

    def round_done(self, outcome: str, seconds: float) -> None:
        self.rounds[outcome] += 1
        self.round_seconds.observe(seconds)


@dataclass
class SessionStats:
    """Session affinity (``broker/affinity.py``): one add per session turn dispatched."""

    dispatches: dict[str, int] = field(default_factory=lambda: _zeros(SESSION_OUTCOMES))
    holds: dict[str, int] = field(default_factory=lambda: _zeros(HOLD_OUTCOMES))
    dropped: dict[str, int] = field(default_factory=lambda: _zeros(SESSION_DROPS))


@dataclass
class BrokerStats:
    submitted: int = 0
    submits: int = 0
    """SUBMIT messages (with ``submitted``: jobs per SUBMIT, ``packing.Packing.blocks``)."""
    completed: int = 0
    failed: int = 0
    cancelled: int = 0
    requeued: int = 0
    stale_restarted: int = 0
    stale: int = 0
    rejected_busy: int = 0
    rejected_invalid: int = 0
    dropped_client_gone: int = 0
    late_replies: int = 0
    unknown_worker_messages: int = 0
    workers_expired: int = 0
    busy_poll_s: float = 0.0
    """CPU seconds the socket loop spent polling without sleeping (``BrokerConfig.busy_poll_us``)."""
    busy: float = 0.0
    """Share of the last review interval (``server.REVIEW_S``) the socket loop spent on its work (``packing.py``)."""
    packing: bool = False
    """Whether dispatch packs jobs (the broker is busy) or gives each to the least loaded worker."""
    messages_received: int = 0
    """Messages the broker read from clients and workers (with ``messages_sent``: messages per job)."""
    messages_sent: int = 0
    """Messages the broker sent to clients and workers (those it could not send included)."""
    split_peers: int = 0
    """Peers whose last message was in the split form (``Broker.split_peers``), at the last tick."""
    malformed: dict[str, int] = field(default_factory=dict)  # by reason
    auth_failures: dict[tuple[str, str], int] = field(default_factory=dict)  # by (port, reason), with CurveZMQ
    job_latency: Histogram = field(default_factory=Histogram)
    queue_wait: Histogram = field(default_factory=Histogram)
    staleness: Histogram = field(default_factory=lambda: Histogram(VERSION_BUCKETS))
    """Per completed sample: the fleet version minus the sample's (its oldest token's)."""
    version_span: Histogram = field(default_factory=lambda: Histogram(VERSION_BUCKETS))
    """Per completed sample whose tokens span a sync: its newest token's version minus its oldest."""
    sync: SyncStats = field(default_factory=SyncStats)
    sessions: SessionStats = field(default_factory=SessionStats)
    workers: dict[str, WorkerTally] = field(default_factory=dict)  # by worker name
    workers_lost: dict[str, int] = field(default_factory=lambda: _zeros(LOSS_REASONS))

    def observe_done(self, seconds: float) -> None:
        self.job_latency.observe(seconds)

    def observe_queue_wait(self, seconds: float) -> None:
        self.queue_wait.observe(seconds)

    def count_malformed(self, reason: str) -> None:
        self.malformed[reason] = self.malformed.get(reason, 0) + 1

    def worker_joined(self, name: str) -> None:
        tally = self.workers.get(name)
        if tally is None:
            tally = self.workers[name] = WorkerTally()
        tally.joins += 1
        tally.live += 1
        tally.gone_since = None

    def worker_lost(self, name: str, reason: str, requeued: int, now: float) -> None:
        self.workers_lost[loss_reason(reason)] += 1
        self._left(name, requeued, now)

    def worker_renamed(self, old: str, new: str, now: float) -> None:
        """A worker said READY again under another name: it counts under the new one."""
        self._left(old, 0, now)
        self.worker_joined(new)

    def _left(self, name: str, requeued: int, now: float) -> None:
        tally = self.workers.get(name)
        if tally is None:
            return
        tally.requeued += requeued
        tally.live -= 1
        if tally.live <= 0:
            tally.gone_since = now

    def forget_gone_workers(self, now: float) -> None:
        """Drop the counters of names gone for ``GONE_WORKER_RETENTION_S`` (their series end)."""
        for name, tally in list(self.workers.items()):
            if tally.gone_since is not None and now - tally.gone_since > GONE_WORKER_RETENTION_S:
                del self.workers[name]
