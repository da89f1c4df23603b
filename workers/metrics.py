"""A worker's Prometheus metrics (own registry): tokens generated, job latency, failures,
and its engine's ``vllm:`` families (``vllm_metrics.py``). docs/metrics.md lists them."""

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import CounterMetricFamily, Metric

from zmq_rollout.gc_pauses import GENERATIONS, GcClock, process_clock
from zmq_rollout.metrics import MetricsServer, start_metrics_server

from .vllm_metrics import VllmCollector

_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600)


class GcCollector:
    """The worker process's garbage collections (``gc_pauses.py``), read at scrape time."""

    def __init__(self, clock: GcClock) -> None:
        self.clock = clock

    def collect(self) -> Iterator[Metric]:
        seconds = CounterMetricFamily(
            "zmq_rollout_worker_gc_seconds",
            "Seconds the worker process spent in Python garbage collection, by generation (its event loop waits).",
            labels=["generation"],
        )
        collections = CounterMetricFamily(
            "zmq_rollout_worker_gc_collections",
            "Python garbage collections in the worker process, by generation (2: full).",
            labels=["generation"],
        )
        for g in GENERATIONS:
            seconds.add_metric([str(g)], self.clock.seconds[g])
            collections.add_metric([str(g)], self.clock.collections[g])
        yield seconds
        yield collections


class WorkerMetrics:
    def __init__(self, worker: str = "", vllm_source: CollectorRegistry | None = None) -> None:
        """``vllm_source``: the registry its engine's vLLM metrics are in, served here labelled ``worker``."""
        self.registry = CollectorRegistry()
        self.registry.register(GcCollector(process_clock()))
        if vllm_source is not None:
            self.registry.register(VllmCollector(worker, vllm_source))
        self.tokens = Counter(
            "zmq_rollout_worker_generated_tokens", "Tokens generated (all samples).", registry=self.registry
        )
        self.jobs = Counter("zmq_rollout_worker_jobs", "Jobs finished with a result.", registry=self.registry)
        self.jobs_failed = Counter(
            "zmq_rollout_worker_jobs_failed", "Jobs that ended in an error, by code.", ["code"], registry=self.registry
        )
        self.latency = Histogram(
            "zmq_rollout_worker_job_latency_seconds",
            "Job start to final result on this worker.",
            buckets=_BUCKETS,
            registry=self.registry,
        )
        self.malformed = Counter(
            "zmq_rollout_worker_malformed_messages",
            "Messages from the broker that failed to decode.",
            registry=self.registry,
        )
        self.loop_stalls = Counter(
            "zmq_rollout_worker_loop_stalls",
            "Times the worker's event loop (its heartbeat too) woke over a second late (loop_watch.py).",
            registry=self.registry,
        )
        self.loop_stalled_seconds = Counter(
            "zmq_rollout_worker_loop_stalled_seconds",
            "Seconds the worker's event loop woke late in those stalls.",
            registry=self.registry,
        )
        self._server: MetricsServer | None = None

    def job_done(self, seconds: float, num_tokens: int) -> None:
        self.jobs.inc()
        self.tokens.inc(num_tokens)
        self.latency.observe(seconds)

    def loop_stalled(self, seconds: float) -> None:
        self.loop_stalls.inc()
        self.loop_stalled_seconds.inc(seconds)

    def serve(self, port: int, host: str = "127.0.0.1") -> int:
        self._server = start_metrics_server(self.registry, port, host)
        return self._server.port

    def close(self) -> None:
        if self._server is not None:
            self._server.shutdown()
            self._server = None
