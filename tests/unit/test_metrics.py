"""The broker's Prometheus endpoint, scraped over loopback HTTP."""

from __future__ import annotations

import urllib.error
import urllib.request
from collections.abc import Iterator
from typing import Any

import pytest
from prometheus_client import REGISTRY, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from zmq_rollout import protocol as p
from zmq_rollout.broker.metrics import SchedulerCollector, serve_metrics
from zmq_rollout.broker.scheduler import Scheduler
from zmq_rollout.config import BrokerConfig
from zmq_rollout.metrics import MetricsServer

A, B = b"trainer-a", b"trainer-b"
W1, W2 = b"worker-1", b"worker-2"


def scrape(server: MetricsServer) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """Every sample of ``/metrics``: (name, sorted labels) -> value."""
    with urllib.request.urlopen(f"http://127.0.0.1:{server.port}/metrics", timeout=5) as response:
        assert response.status == 200
        text = response.read().decode()
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def busy_scheduler() -> Scheduler:
    """A scheduler after some activity: 2 workers, 2 clients, one of each outcome."""
    s = Scheduler(BrokerConfig(max_queue_per_client=6))
    s.worker_ready(W1, p.WorkerInfo("w1", "tiny", 2), now=0.0)
    s.worker_ready(W2, p.WorkerInfo("w2", "tiny", 1), now=0.0)
    s.submit(A, [p.JobSpec(f"a{i}", prompt="x") for i in range(7)], now=0.0)  # 3 run, 3 queued, 1 busy
    s.submit(B, [p.JobSpec("b0", prompt="x")], now=0.0)
    tickets = sorted(s.workers[W1].running)
    s.worker_final(W1, [p.Result(tickets[0], [1], [], 0, "w1")], now=0.3)  # completed in 0.3 s
    s.worker_error(W1, [p.ErrorItem(tickets[1], "internal", "boom")], now=0.4)
    s.stats.count_malformed("invalid")
    s.stats.count_malformed("invalid")
    s.outbox.take()
    return s


@pytest.fixture(scope="module")
def scheduler() -> Scheduler:
    """Shared by the read-only tests below (each server shutdown costs ~0.5 s)."""
    return busy_scheduler()


@pytest.fixture(scope="module")
def server(scheduler: Scheduler) -> Iterator[MetricsServer]:
    running = serve_metrics(scheduler, 0, "127.0.0.1")
    yield running
    running.shutdown()


def test_job_counters(server: MetricsServer, scheduler: Scheduler) -> None:
    samples = scrape(server)

    def jobs(outcome: str) -> float:
        return samples[("zmq_rollout_jobs_total", (("outcome", outcome),))]

    assert jobs("submitted") == 7
    assert jobs("completed") == 1
    assert jobs("failed") == 1
    assert jobs("rejected_busy") == 1
    assert jobs("cancelled") == 0
    assert samples[("zmq_rollout_malformed_messages_total", (("reason", "invalid"),))] == 2
    for reason in ("oversize", "invalid_job", "worker", "unroutable"):  # from 0: a first one shows in rate()
        assert samples[("zmq_rollout_malformed_messages_total", (("reason", reason),))] == 0


def test_queue_and_worker_gauges(server: MetricsServer, scheduler: Scheduler) -> None:
    samples = scrape(server)
    # The final and the error freed W1's two credits for a3 and b0 (fair turns); a4, a5 wait.
    assert samples[("zmq_rollout_queue_depth", (("client", "trainer-a"),))] == len(scheduler.clients[A].queued) == 2
    assert samples[("zmq_rollout_queue_depth", (("client", "trainer-b"),))] == 0
    assert samples[("zmq_rollout_running_jobs", (("client", "trainer-a"),))] == len(scheduler.clients[A].running) == 2
    assert samples[("zmq_rollout_running_jobs", (("client", "trainer-b"),))] == 1
    assert samples[("zmq_rollout_queued_jobs", ())] == scheduler.num_queued == 2
    assert samples[("zmq_rollout_workers", (("state", "ready"),))] == 2
    assert samples[("zmq_rollout_workers", (("state", "syncing"),))] == 0
    assert samples[("zmq_rollout_workers", (("state", "stale"),))] == 0
    assert samples[("zmq_rollout_credits", ())] == 3
    assert samples[("zmq_rollout_credits_free", ())] == 0


def test_latency_histograms(server: MetricsServer) -> None:
    samples = scrape(server)

    def bucket(name: str, le: str) -> float:
        return samples[(f"{name}_bucket", (("le", le),))]

    latency = "zmq_rollout_job_latency_seconds"
    assert bucket(latency, "0.25") == 0
    assert bucket(latency, "0.5") == 1  # the one completed job took 0.3 s
    assert bucket(latency, "+Inf") == 1
    assert samples[(f"{latency}_count", ())] == 1
    assert samples[(f"{latency}_sum", ())] == pytest.approx(0.3)
    wait = "zmq_rollout_queue_wait_seconds"
    buckets = [v for (name, _), v in samples.items() if name == f"{wait}_bucket"]
    assert buckets == sorted(buckets)  # cumulative
    assert bucket(wait, "+Inf") == samples[(f"{wait}_count", ())] == 5  # one per dispatch


def test_own_registry_and_no_job_ids_in_labels(server: MetricsServer) -> None:
    assert b"zmq_rollout_" not in generate_latest(REGISTRY)
    labels = {value for (_, pairs) in scrape(server) for _, value in pairs}
    assert "trainer-a" in labels
    assert labels.isdisjoint({f"a{i}" for i in range(7)} | {"b0"})


def test_metrics_follow_the_scheduler_between_scrapes_and_shutdown_stops_serving() -> None:
    scheduler = busy_scheduler()
    running = serve_metrics(scheduler, 0, "127.0.0.1")
    try:
        before = scrape(running)[("zmq_rollout_jobs_total", (("outcome", "completed"),))]
        ticket = next(iter(scheduler.workers[W2].running))
        scheduler.worker_final(W2, [p.Result(ticket, [1], [], 0, "w2")], now=1.0)
        after = scrape(running)
        assert after[("zmq_rollout_jobs_total", (("outcome", "completed"),))] == before + 1
        assert after[("zmq_rollout_job_latency_seconds_count", ())] == 2
    finally:
        running.shutdown()
    with pytest.raises((urllib.error.URLError, ConnectionError)):
        urllib.request.urlopen(f"http://127.0.0.1:{running.port}/metrics", timeout=2)


def test_collector_survives_concurrent_mutation(monkeypatch: Any) -> None:
    """The broker thread mutates the scheduler during a scrape; a race is retried, not fatal."""
    collector = SchedulerCollector(busy_scheduler())
    real = collector._collect
    calls = {"n": 0}

    def flaky() -> Any:
        calls["n"] += 1
        if calls["n"] == 1:
            raise RuntimeError("dictionary changed size during iteration")
        return real()

    monkeypatch.setattr(collector, "_collect", flaky)
    names = {m.name for m in collector.collect()}
    assert "zmq_rollout_jobs" in names
    assert calls["n"] == 2


def test_metrics_endpoints_bind_loopback_unless_told_otherwise() -> None:
    from zmq_rollout.workers.metrics import WorkerMetrics

    assert BrokerConfig().metrics_host == "127.0.0.1"
    running = serve_metrics(busy_scheduler(), 0)
    worker = WorkerMetrics()
    try:
        assert running._server.server_address[0] == "127.0.0.1"
        worker.serve(0)
        assert worker._server is not None and worker._server._server.server_address[0] == "127.0.0.1"
    finally:
        running.shutdown()
        worker.close()
