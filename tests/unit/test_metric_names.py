"""Metric names follow the conventions (docs/metrics.md): every family the broker and a
worker serve, checked by ``helpers.metric_name_problems``, which is itself shown to catch
each broken convention. A worker's vLLM families are checked here through a stand-in
registry (no engine); tests/integration/test_prometheus_scrape.py checks the real ones."""

from __future__ import annotations

import re
import urllib.request

import pytest
from helpers import metric_name_problems, parse_samples
from prometheus_client import CollectorRegistry, Counter, Gauge, generate_latest
from prometheus_client import Histogram as PromHistogram

from zmq_rollout import codec
from zmq_rollout import protocol as p
from zmq_rollout.broker.metrics import serve_metrics
from zmq_rollout.broker.scheduler import Scheduler
from zmq_rollout.workers.metrics import WorkerMetrics

T, C = b"trainer", b"client"
W1, W2 = b"w1-a", b"w2-b"


def families(text: str) -> set[str]:
    return set(re.findall(r"^# TYPE (\S+) ", text, re.MULTILINE))


def lived_in_scheduler() -> Scheduler:
    """A scheduler that has seen every kind of event its metrics count: jobs of each outcome, a
    committed round with a bucket and an eviction, a result that crossed the sync, a purge."""
    s = Scheduler()
    for w in (W1, W2):
        s.worker_ready(w, p.WorkerInfo(w.decode()[:2], "m", 4), 0.0)
    s.submit(C, [p.JobSpec(f"j{i}", prompt="x") for i in range(3)], 0.0)
    s.cancel(C, ["j2"], 0.0)
    s.stats.count_malformed("invalid")
    s.stats.auth_failures[("frontend", "handshake")] = 1
    tickets = [a.ticket for _, ident, cmd, body in s.outbox.take() if cmd == p.JOBS and ident == W1 for a in body]
    s.sync.step(T, p.SyncStep(0, p.Begin("abort"), 1.0), 1.0)
    rnd = next(body.round_id for _, _, cmd, body in s.outbox.take() if cmd == p.CONTROL)
    s.sync.ack(W1, p.ControlAck(rnd, "begin", True, 0, "", 1), 1.1)
    s.tick(2.5)  # W2 missed the deadline: evicted, its job requeued
    bucket = p.Bucket(0, 8, [p.TensorMeta("w", "float32", [2], 0, 8)])
    s.sync.step(T, p.SyncStep(rnd, p.LoadShm("/zr", bucket, begin=True, finish=True)), 3.0)
    s.sync.ack(W1, p.ControlAck(rnd, "load_shm", False, 0, "boom"), 3.1)
    s.sync.step(T, p.SyncStep(rnd, p.Commit(1)), 4.0)
    s.sync.ack(W1, p.ControlAck(rnd, "commit", True, 1, "", 1), 4.1)
    crossed = p.Result(tickets[0], [1], [p.Sample(0, [5, 6], [-0.1, -0.2], "length", None, [0, 1])], 1, "w1")
    s.worker_final(W1, codec.Decoder(codec.FROM_WORKER).decode(codec.encode(p.FINAL, [crossed])).body, 5.0)
    s.outbox.take()
    return s


def test_every_broker_family_follows_the_conventions() -> None:
    server = serve_metrics(lived_in_scheduler(), 0, "127.0.0.1")
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{server.port}/metrics", timeout=5) as response:
            text = response.read().decode()
    finally:
        server.shutdown()
    assert metric_name_problems(text) == []
    names = families(text)
    assert len(names) >= 30, sorted(names)  # the checker saw every family, not an empty page
    samples = parse_samples(text)
    assert samples["zmq_rollout_sync_rounds_total{outcome=committed}"] == 1  # the events did happen
    assert samples["zmq_rollout_sample_span_versions_count"] == 1


def vllm_stand_in() -> CollectorRegistry:
    """Families shaped as vLLM's PrometheusStatLogger registers them, and one that is not vLLM's."""
    registry = CollectorRegistry()
    labels = ["model_name", "engine"]
    Gauge("vllm:num_requests_running", "Requests running.", labels, registry=registry).labels("m", "0").set(2)
    Gauge("vllm:kv_cache_usage_perc", "KV-cache usage.", labels, registry=registry).labels("m", "0").set(0.5)
    Counter("vllm:prompt_tokens", "Prompt tokens.", labels, registry=registry).labels("m", "0").inc(7)
    ttft = PromHistogram("vllm:time_to_first_token_seconds", "TTFT.", labels, registry=registry, buckets=(0.1, 1))
    ttft.labels("m", "0").observe(0.05)
    Gauge("process_open_fds", "Not vLLM's.", registry=registry).set(9)
    return registry


def test_every_worker_family_follows_the_conventions_and_vllm_families_get_the_worker_label() -> None:
    metrics = WorkerMetrics("host-gpu1", vllm_stand_in())
    metrics.job_done(0.2, 12)
    metrics.jobs_failed.labels("job_failed").inc()
    metrics.malformed.inc()
    text = generate_latest(metrics.registry).decode()
    assert metric_name_problems(text) == []
    names = families(text)
    assert "process_open_fds" not in names  # only vLLM's families come across
    samples = parse_samples(text)
    assert samples["vllm:num_requests_running{engine=0,model_name=m,worker=host-gpu1}"] == 2
    assert samples["vllm:prompt_tokens_total{engine=0,model_name=m,worker=host-gpu1}"] == 7
    assert samples["vllm:time_to_first_token_seconds_bucket{engine=0,le=0.1,model_name=m,worker=host-gpu1}"] == 1
    assert samples["zmq_rollout_worker_generated_tokens_total"] == 12
    assert not any(n.startswith("vllm:") for n in families(generate_latest(WorkerMetrics().registry).decode()))


def test_broker_and_worker_families_do_not_share_a_name() -> None:
    registry = CollectorRegistry()
    from zmq_rollout.broker.metrics import SchedulerCollector

    registry.register(SchedulerCollector(lived_in_scheduler()))
    broker = families(generate_latest(registry).decode())
    worker = families(generate_latest(WorkerMetrics().registry).decode())
    assert broker & worker == set()


@pytest.mark.parametrize(
    ("exposition", "problem"),
    [
        ("# TYPE rollout_queue_depth gauge\nrollout_queue_depth 1\n", "not named zmq_rollout_"),
        ("# TYPE zmq_rollout_jobs counter\nzmq_rollout_jobs 3\n", "a counter not ending in _total"),
        ("# TYPE zmq_rollout_requests_total gauge\nzmq_rollout_requests_total 3\n", "a gauge ending in _total"),
        ("# TYPE zmq_rollout_latency_ms gauge\nzmq_rollout_latency_ms 3\n", "a non-base unit (ms"),
        (
            "# TYPE zmq_rollout_sync_step_duration gauge\nzmq_rollout_sync_step_duration 3\n",
            "a duration not in seconds",
        ),
        ("# TYPE zmq_rollout_bucket_size gauge\nzmq_rollout_bucket_size 3\n", "a size not in bytes"),
        ("# TYPE zmq_rollout_sync_kb_total counter\nzmq_rollout_sync_kb_total 3\n", "a non-base unit (kb"),
        (
            "# TYPE zmq_rollout_job_tokens histogram\n"
            'zmq_rollout_job_tokens_bucket{le="+Inf"} 1\n'
            "zmq_rollout_job_tokens_count 1\nzmq_rollout_job_tokens_sum 1\n",
            "a histogram not in seconds, bytes, versions",
        ),
        ('# TYPE zmq_rollout_running gauge\nzmq_rollout_running{job_id="a1"} 1\n', "label 'job_id' names an id"),
        ('# TYPE zmq_rollout_running gauge\nzmq_rollout_running{ticket="7"} 1\n', "label 'ticket' names an id"),
        ('# TYPE vllm:num_requests gauge\nvllm:num_requests{request_id="r"} 1\n', "label 'request_id' names an id"),
    ],
)
def test_the_checker_catches_each_broken_convention(exposition: str, problem: str) -> None:
    found = metric_name_problems(exposition)
    assert any(problem in f for f in found), found


def test_the_checker_accepts_conventional_names_and_vllms_own() -> None:
    good = (
        '# TYPE zmq_rollout_sync_bytes_total counter\nzmq_rollout_sync_bytes_total{step="load_shm"} 3\n'
        "# TYPE zmq_rollout_worker_heartbeat_age_seconds gauge\n"
        'zmq_rollout_worker_heartbeat_age_seconds{worker="w"} 0.2\n'
        '# TYPE vllm:kv_cache_usage_perc gauge\nvllm:kv_cache_usage_perc{engine="0"} 0.1\n'
        "# TYPE vllm:iteration_tokens_total histogram\n"
        'vllm:iteration_tokens_total_bucket{le="+Inf"} 1\nvllm:iteration_tokens_total_count 1\n'
        "vllm:iteration_tokens_total_sum 1\n"
    )
    assert metric_name_problems(good) == []


def test_vllm_names_survive_a_scraper_that_asks_for_openmetrics() -> None:
    """Prometheus 2.x asks for OpenMetrics first; prometheus_client's OpenMetrics turns the
    ``:`` of sample names into ``_`` (not in ``# TYPE``) and Prometheus then keeps nothing of
    the scrape. The endpoint answers in the 0.0.4 text format, names as registered."""
    metrics = WorkerMetrics("w", vllm_stand_in())
    port = metrics.serve(0)
    accept = "application/openmetrics-text;version=1.0.0,application/openmetrics-text;version=0.0.1;q=0.75,*/*;q=0.1"
    try:
        request = urllib.request.Request(f"http://127.0.0.1:{port}/metrics", headers={"Accept": accept})
        with urllib.request.urlopen(request, timeout=5) as response:
            kind, text = response.headers["Content-Type"], response.read().decode()
    finally:
        metrics.close()
    assert kind.startswith("text/plain; version=0.0.4")
    assert 'vllm:num_requests_running{engine="0",model_name="m",worker="w"} 2.0' in text.splitlines()
    assert "vllm_num_requests_running" not in text
