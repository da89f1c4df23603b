"""The broker's hot path touches no Prometheus object per job (docs/metrics.md, Conventions).

Every method of prometheus_client that changes a metric (``Counter.inc``, ``Gauge.set``,
``Histogram.observe``, ... and ``labels``), the value cell under every metric child, and the
construction of a metric object or of a metric family are patched to count their calls, per
thread. Jobs then go through the broker, and the count on the broker's thread must not grow
with the number of jobs: it stays 0. Twice: the pure scheduler driven event by event (every
per-job path: dispatch, results fresh, stale and across a sync, errors, cancels, streamed
tokens, heartbeats, ticks), and a real broker loop on its thread with echo doubles and a
client. A scrape may build families (the collectors do, at scrape time, on the HTTP
server's thread): bounded by the fleet, not by the jobs.
``test_the_check_fails_on_a_counter_per_job`` shows that the check catches a per-job
``counter.inc()``.
"""

from __future__ import annotations

import collections
import functools
import threading
from collections.abc import Callable, Iterator
from typing import Any

import pytest
from prometheus_client import CollectorRegistry, generate_latest, metrics, metrics_core, values

from zmq_rollout import codec
from zmq_rollout import protocol as p
from zmq_rollout.broker.metrics import SchedulerCollector
from zmq_rollout.broker.scheduler import Scheduler
from zmq_rollout.config import BrokerConfig

PATCHED: dict[type, tuple[str, ...]] = {
    metrics.MetricWrapperBase: ("__init__", "labels", "remove", "remove_by_labels", "clear"),
    metrics.Counter: ("inc", "reset"),
    metrics.Gauge: ("inc", "dec", "set", "set_to_current_time", "set_function"),
    metrics.Summary: ("observe",),
    metrics.Histogram: ("observe",),
    metrics.Info: ("info",),
    metrics.Enum: ("state",),
    values.ValueClass: ("inc", "set", "set_exemplar"),  # the cell every metric child writes to
    metrics_core.Metric: ("__init__", "add_sample"),  # a metric family (what a collector yields)
}

Tally = collections.Counter  # "Class.method" -> calls


class Calls:
    """Calls of the patched methods, by thread."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._calls: collections.Counter[tuple[int, str]] = collections.Counter()

    def add(self, name: str) -> None:
        with self._lock:
            self._calls[(threading.get_ident(), name)] += 1

    def on(self, thread: int | None = None) -> Tally[str]:
        """The calls made on ``thread`` (this one by default) so far."""
        ident = threading.get_ident() if thread is None else thread
        with self._lock:
            return Tally({name: n for (t, name), n in self._calls.items() if t == ident})

    def anywhere(self) -> Tally[str]:
        with self._lock:
            out: Tally[str] = Tally()
            for (_, name), n in self._calls.items():
                out[name] += n
            return out


def _counting(calls: Calls, name: str, original: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(original)
    def method(*args: Any, **kw: Any) -> Any:
        calls.add(name)
        return original(*args, **kw)

    return method


@pytest.fixture
def prometheus_calls(monkeypatch: pytest.MonkeyPatch) -> Calls:
    calls = Calls()
    for cls, names in PATCHED.items():
        for name in names:
            original = getattr(cls, name, None)
            if original is not None:  # else not in this prometheus_client version
                monkeypatch.setattr(cls, name, _counting(calls, f"{cls.__name__}.{name}", original))
    return calls


def test_the_patch_sees_each_kind_of_metric(prometheus_calls: Calls) -> None:
    """The instrument itself: a use of each metric type is counted."""
    registry = CollectorRegistry()
    counter = metrics.Counter("c", "c", ["x"], registry=registry)
    gauge = metrics.Gauge("g", "g", registry=registry)
    hist = metrics.Histogram("h", "h", registry=registry)
    summary = metrics.Summary("s", "s", registry=registry)
    counter.labels("a").inc()
    gauge.set(3)
    gauge.inc()
    hist.observe(0.5)
    summary.observe(1.0)
    generate_latest(registry)
    seen = prometheus_calls.on()
    for name in ("MetricWrapperBase.__init__", "MetricWrapperBase.labels", "Counter.inc", "Gauge.set", "Gauge.inc"):
        assert seen[name] >= 1, name
    assert seen["Histogram.observe"] == seen["Summary.observe"] == 1
    assert seen[f"{values.ValueClass.__name__}.inc"] >= 4  # counter, gauge, histogram bucket and sum, summary
    assert seen["Metric.__init__"] >= 4  # the scrape built the families


# -- the scheduler, driven event by event -----------------------------------------------------
C = b"trainer-a"
WORKERS = {b"w1-ab12": "w1", b"w2-cd34": "w2"}
BATCH = 64


def relayed(command: bytes, body: list[Any]) -> Any:
    """``body`` as the broker gets it off the wire from a worker (token payloads left raw)."""
    return codec.Decoder(codec.FROM_WORKER).decode(codec.encode(command, body)).body


class Fleet:
    """A scheduler with two workers and one client, and the clock and version it is at."""

    def __init__(self) -> None:
        self.s = Scheduler(BrokerConfig(max_queue_per_client=4 * BATCH))
        self.now = 0.0
        self.version = 0
        self.batches = 0
        for identity, name in WORKERS.items():
            self.s.worker_ready(identity, p.WorkerInfo(name, "tiny", BATCH), self.now)
        self.s.outbox.take()

    def sync_round(self) -> None:
        """A whole weight-sync round to the next version, both workers acking each step."""
        s, self.version = self.s, self.version + 1
        rnd = 0
        for op, ack_op in (
            (p.Begin(), "begin"),
            (
                p.LoadShm("/zr", p.Bucket(0, 8, [p.TensorMeta("w", "float32", [2], 0, 8)]), begin=True, finish=True),
                "load_shm",
            ),
            (p.Commit(self.version), "commit"),
        ):
            self.now += 0.001
            s.sync.step(C, p.SyncStep(rnd, op, 60.0), self.now)
            controls = [body for _, _, cmd, body in s.outbox.take() if cmd == p.CONTROL]
            rnd = controls[0].round_id
            held = self.version if ack_op == "commit" else self.version - 1
            for identity in WORKERS:
                ack = p.ControlAck(rnd, ack_op, True, held, "", self.version if ack_op == "commit" else None)
                s.sync.ack(identity, ack, self.now)
            s.outbox.take()

    def run(self, jobs: int) -> None:
        """``jobs`` jobs, ``BATCH`` per SUBMIT, as the broker's loop would feed them: client and
        worker heartbeats, dispatch to both workers, streamed tokens of one job, one job
        cancelled while it runs and its late result dropped, one failed by its worker, the rest
        answered by FINALs (one per worker); every third batch runs across a sync round, so its
        results are stale, and half of those carry per-token versions (decoded for staleness);
        a tick per batch."""
        s = self.s
        for _ in range(jobs // BATCH):
            b, self.batches = self.batches, self.batches + 1
            self.now += 0.01
            s.client_seen(C, self.now)
            s.submit(C, [p.JobSpec(f"j{b}-{i}", p.SamplingParams(n=2), prompt="x") for i in range(BATCH)], self.now)
            out = s.outbox.take()
            assigned = {w: body for _, w, cmd, body in out if cmd == p.JOBS}
            assert sum(map(len, assigned.values())) == BATCH, "every job of the batch was dispatched"
            dispatched = self.version
            if b % 3 == 1:
                self.sync_round()
            self.now += 0.01
            first = next(iter(assigned.values()))[0]
            s.cancel(C, [first.job.job_id], self.now)
            for w, assignments in assigned.items():
                s.worker_seen(w, self.now)
                ticket = assignments[-1].ticket
                delta = p.Delta(ticket, 0, [5, 6], [-0.1, -0.2])
                s.worker_partial(w, relayed(p.PARTIAL, [delta]), self.now)
                s.worker_error(w, relayed(p.ERROR, [p.ErrorItem(ticket, "job_failed", "boom")]), self.now)
                results = []
                for i, a in enumerate(assignments[:-1]):
                    crossed = dispatched != self.version and i % 2 == 0
                    versions = [dispatched, self.version] if crossed else None
                    samples = [p.Sample(k, [5, 6], [-0.1, -0.2], "length", None, versions) for k in range(2)]
                    version = self.version if crossed else dispatched
                    results.append(p.Result(a.ticket, [1, 2], samples, version, WORKERS[w]))
                s.worker_final(w, relayed(p.FINAL, results), self.now)
            s.tick(self.now)
            s.outbox.take()


def scrape(s: Scheduler) -> str:
    registry = CollectorRegistry()
    registry.register(SchedulerCollector(s, lambda: 0.0))
    return generate_latest(registry).decode()


def hot_path_calls(calls: Calls, drive: Callable[[int], None], small: int, large: int) -> tuple[Tally[str], Tally[str]]:
    """The patched calls on this thread while ``drive`` runs ``small`` jobs, then ``large`` jobs."""
    before = calls.on()
    drive(small)
    middle = calls.on()
    drive(large)
    after = calls.on()
    return middle - before, after - middle


def check_no_prometheus_per_job(small: Tally[str], large: Tally[str], jobs: tuple[int, int]) -> None:
    """What the broker's hot path may cost in Prometheus calls: nothing per job, nothing at all."""
    grew = {name: (small[name], large[name]) for name in small | large if large[name] > small[name]}
    assert not grew, f"Prometheus calls grew with the jobs ({jobs[0]} -> {jobs[1]} jobs): {grew}"
    assert not small and not large, f"the hot path touched Prometheus objects: {dict(small | large)}"


def test_scheduler_touches_no_prometheus_object_per_job(prometheus_calls: Calls) -> None:
    fleet = Fleet()
    fleet.run(BATCH)  # first contact of the client and workers
    first_scrape = prometheus_calls.on()
    text_a = scrape(fleet.s)
    scrape_a = prometheus_calls.on() - first_scrape
    small, large = hot_path_calls(prometheus_calls, fleet.run, 2 * BATCH, 30 * BATCH)
    check_no_prometheus_per_job(small, large, (2 * BATCH, 30 * BATCH))

    # The jobs went through every path (else the check proved little) ...
    stats = fleet.s.stats
    assert stats.completed == 33 * (BATCH - 3)  # per batch: one cancelled, two failed
    assert stats.cancelled == 33 and stats.failed == 66 and stats.late_replies >= 33
    assert stats.version_span.count > 0  # results that crossed a sync were decoded
    # ... and a scrape still shows them, its cost set by the fleet, not by the jobs.
    before = prometheus_calls.on()
    text_b = scrape(fleet.s)
    assert prometheus_calls.on() - before == scrape_a and scrape_a["Metric.__init__"] > 0
    assert f'zmq_rollout_jobs_total{{outcome="completed"}} {float(stats.completed)}' in text_b
    assert text_a != text_b


def test_the_check_fails_on_a_counter_per_job(prometheus_calls: Calls, monkeypatch: pytest.MonkeyPatch) -> None:
    """A ``counter.inc()`` per result added to ``worker_final`` is caught."""
    completed = metrics.Counter("completed_jobs", "Completed jobs.", registry=CollectorRegistry())
    original = Scheduler.worker_final

    def worker_final(self: Scheduler, identity: bytes, results: list[Any], now: float) -> None:
        for _ in results:
            completed.inc()
        original(self, identity, results, now)

    monkeypatch.setattr(Scheduler, "worker_final", worker_final)
    fleet = Fleet()
    small, large = hot_path_calls(prometheus_calls, fleet.run, BATCH, 10 * BATCH)
    assert large["Counter.inc"] >= 10 * (BATCH - 2)  # one per FINAL result, the cancelled one's included
    with pytest.raises(AssertionError, match="grew with the jobs"):
        check_no_prometheus_per_job(small, large, (BATCH, 10 * BATCH))


# -- the broker's socket loop on its thread ---------------------------------------------------
def broker_thread() -> int:
    threads = [t for t in threading.enumerate() if t.name == "zmq-rollout-broker" and t.is_alive()]
    assert len(threads) == 1, threads
    assert threads[0].ident is not None
    return threads[0].ident


@pytest.fixture
def loop(start_broker: Any, start_double: Any, start_client: Any) -> Iterator[tuple[Any, Any]]:
    broker = start_broker()
    for _ in range(2):
        start_double(broker, credits=BATCH)
    yield broker, start_client(broker.frontend)


def test_broker_loop_touches_no_prometheus_object_per_job(prometheus_calls: Calls, loop: tuple[Any, Any]) -> None:
    broker, client = loop
    ident = broker_thread()
    params = p.SamplingParams(max_tokens=4)

    def drive(jobs: int) -> None:
        for _ in range(jobs // BATCH):
            assert len(client.generate(["x"] * BATCH, params)) == BATCH

    before = prometheus_calls.on(ident)
    drive(BATCH)
    middle = prometheus_calls.on(ident)
    drive(10 * BATCH)
    after = prometheus_calls.on(ident)
    check_no_prometheus_per_job(middle - before, after - middle, (BATCH, 10 * BATCH))
    assert not after, f"the broker's thread touched Prometheus objects: {dict(after)}"

    # /metrics has them: the collector built its families on the HTTP server's thread.
    families = prometheus_calls.anywhere()["Metric.__init__"]
    assert broker.jobs("completed") == 11 * BATCH
    assert prometheus_calls.anywhere()["Metric.__init__"] > families
    assert not prometheus_calls.on(ident)
