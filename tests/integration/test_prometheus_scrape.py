"""The broker's ``/metrics`` scraped by a REAL Prometheus server, queried with PromQL.

test_metrics.py checks the exposition text; this checks that Prometheus itself accepts it:
the target is ``up``, the job counter reads back through PromQL, and a histogram quantile
over the latency buckets is a number. Everything runs on loopback.

The server is ``prometheus_helpers.Prometheus``: a missing binary FAILS the test, so it cannot
rot as a skip; set ``ZMQ_ROLLOUT_NO_PROMETHEUS=1`` to skip it deliberately.
"""

from __future__ import annotations

import math
import re
import socket
import time
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml
from helpers import free_port, poll_until
from prometheus_helpers import JOB, Prometheus, prometheus_binary, start_prometheus_fixture  # noqa: F401

from zmq_rollout import protocol as p

NUM_PROMPTS = 25
DEADLINE_S = 20.0  # Prometheus start + first scrapes at a 1 s interval take a few seconds


def test_prometheus_scrapes_the_broker(
    start_broker: Any,
    start_double: Any,
    start_client: Any,
    wait_until: Any,
    start_prometheus: Callable[..., Prometheus],  # last: torn down first
) -> None:
    prometheus_binary()  # first: a missing binary fails the test (not its setup) before any work
    deadline = time.monotonic() + DEADLINE_S
    metrics_port = free_port()
    broker = start_broker(metrics_port=metrics_port)
    start_double(broker)
    client = start_client(broker.frontend)

    prompts = [f"prompt {i}" for i in range(NUM_PROMPTS)]
    rollouts = client.generate(prompts, p.SamplingParams(n=2, max_tokens=4))
    assert len(rollouts) == 2 * NUM_PROMPTS
    wait_until(lambda: broker.jobs("completed") == NUM_PROMPTS, what="the broker to count every job")

    prometheus = start_prometheus([f"127.0.0.1:{metrics_port}"])
    prometheus.wait_ready(deadline)

    completed = prometheus.wait_value(
        'zmq_rollout_jobs_total{outcome="completed"}', lambda v: v == NUM_PROMPTS, deadline
    )
    assert completed == NUM_PROMPTS
    assert prometheus.wait_value(f'up{{job="{JOB}"}}', lambda v: v == 1, deadline) == 1
    p90 = prometheus.wait_value(
        "histogram_quantile(0.9, zmq_rollout_job_latency_seconds_bucket)", math.isfinite, deadline
    )
    assert 0 < p90 <= 60, f"p90 job latency of {p90} s for echo jobs on loopback"
    submitted = prometheus.query(f'zmq_rollout_jobs_total{{job="{JOB}", outcome="submitted"}}')
    assert [float(r["value"][1]) for r in submitted] == [NUM_PROMPTS]


# =========================================================================================
# The whole fleet: real vLLM CPU engines, a weight sync, and the alerting rules.
# =========================================================================================

ALERTS = Path(__file__).resolve().parents[2] / "deploy" / "prometheus" / "alerts.yml"
VLLM_FAMILIES = (  # the list, as vLLM names them
    "vllm:num_requests_running",
    "vllm:num_requests_waiting",
    "vllm:kv_cache_usage_perc",
    "vllm:prefix_cache_queries_total",
    "vllm:prefix_cache_hits_total",
    "vllm:prompt_tokens_total",
    "vllm:generation_tokens_total",
    "vllm:time_to_first_token_seconds_count",
    "vllm:inter_token_latency_seconds_count",
    "vllm:num_preemptions_total",
)
FLEET_DEADLINE_S = 60.0


def free_port_pair() -> int:
    """A port ``p`` with ``p`` and ``p + 1`` both free now (a worker of two engines serves both)."""
    for _ in range(50):
        port = free_port()
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
            try:
                sock.bind(("127.0.0.1", port + 1))
            except OSError:
                continue
        return port
    raise RuntimeError("no two adjacent free ports on loopback")


@pytest.fixture(scope="module")
def fleet(tiny_model: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Any, int]]:
    """A broker with /metrics and ONE worker process of two engines (``--gpus 0,1``: on the
    CPU build both run on the CPU, each in its own process, with its own name and port)."""
    from zmq_rollout.config import BrokerConfig
    from zmq_rollout.local import LocalCluster

    config = BrokerConfig(
        frontend="tcp://127.0.0.1:*",
        backend="tcp://127.0.0.1:*",
        heartbeat_interval_s=0.5,
        worker_liveness=10,
        metrics_port=free_port(),
    )
    cluster = LocalCluster(
        tiny_model, num_workers=0, broker_config=config, log_dir=str(tmp_path_factory.mktemp("logs"))
    )
    worker_port = free_port_pair()
    try:
        cluster.start()
        cluster.start_worker("worker", gpus="0,1", metrics_port=worker_port)
        cluster.wait_for_workers(2, 300)
        yield cluster, worker_port
    finally:
        cluster.stop()


def test_prometheus_sees_sync_rounds_versions_staleness_and_each_engines_vllm_metrics(
    fleet: tuple[Any, int], tiny_model: str, start_prometheus: Callable[..., Prometheus]
) -> None:
    from helpers import metric_name_problems
    from model_helpers import trained_model

    from zmq_rollout.blocking import RolloutClient

    prometheus_binary()
    cluster, worker_port = fleet
    assert sorted(cluster.registered()) == ["worker-gpu0", "worker-gpu1"]
    prompts = [[(7 * i + j) % 200 + 3 for j in range(5)] for i in range(8)]
    with RolloutClient(cluster.address, timeout_s=300) as client:
        first = client.generate(prompts, p.SamplingParams(n=2, max_tokens=8, ignore_eos=True))
        report = client.update_weights(
            trained_model(tiny_model, 11), transport="shm", bucket_bytes=200_000, timeout_s=120
        )
        then = client.generate(prompts[:4], p.SamplingParams(max_tokens=8, ignore_eos=True))
    assert report.workers_evicted == [] and report.num_buckets > 1
    assert {r.weight_version for r in then} == {report.version}
    samples = len(first) + len(then)

    broker, workers = f"127.0.0.1:{cluster.metrics_port}", [f"127.0.0.1:{worker_port + i}" for i in range(2)]
    for target in (broker, *workers):  # what Prometheus will scrape, read once by hand
        with urllib.request.urlopen(f"http://{target}/metrics", timeout=5) as response:
            assert metric_name_problems(response.read().decode()) == [], target
    deadline = time.monotonic() + FLEET_DEADLINE_S
    prometheus = start_prometheus({JOB: [broker], "zmq-rollout-worker": workers}, [ALERTS])
    prometheus.wait_ready(deadline)

    def value(promql: str, want: float) -> None:
        assert prometheus.wait_value(promql, lambda v: v == want, deadline) == want

    value("count(up == 1)", 3)
    value('zmq_rollout_sync_rounds_total{outcome="committed"}', 1)
    value("sum(zmq_rollout_sync_rounds_total)", 1)
    value("zmq_rollout_sync_rounds_in_progress", 0)
    value("zmq_rollout_sync_round_duration_seconds_count", 1)
    value('sum(zmq_rollout_sync_step_duration_seconds_count{step="load_shm"})', report.num_buckets)
    value('zmq_rollout_sync_bytes_total{step="load_shm"}', 2 * report.bytes)  # each engine loaded each bucket
    value("zmq_rollout_fleet_weight_version", report.version)
    value(f"count(zmq_rollout_worker_weight_version == {report.version})", 2)
    value("sum(zmq_rollout_worker_completed_jobs_total)", len(prompts) + len(then))
    value("sum(zmq_rollout_worker_credits_free)", 2 * 64)
    value("zmq_rollout_sample_staleness_versions_count", samples)
    value('zmq_rollout_sample_staleness_versions_bucket{le="0.0"}', samples)  # a wait-mode sync: none stale
    for family in VLLM_FAMILIES:  # one series per engine, told apart by worker (vLLM's engine is 0 in both)
        value(f'count(count by (worker, engine) ({family}{{job="zmq-rollout-worker"}}))', 2)
    generated = prometheus.wait_value("sum(vllm:generation_tokens_total)", lambda v: v >= 8 * samples, deadline)
    assert generated <= 8 * samples + 2 * 4, generated  # + each engine's warm-up

    # The alerting rules load, evaluate over these series without error, and none fires.
    def evaluated() -> list[dict[str, Any]]:
        rules = [r for g in prometheus._get("/api/v1/rules")["data"]["groups"] for r in g["rules"]]
        return rules if rules and all(not r["lastEvaluation"].startswith("0001") for r in rules) else []

    rules = poll_until(evaluated, timeout=max(1.0, deadline - time.monotonic()), what="every rule to be evaluated")
    written = [r["alert"] for g in yaml.safe_load(ALERTS.read_text())["groups"] for r in g["rules"]]
    assert sorted(r["name"] for r in rules) == sorted(written) and len(written) >= 7, rules  # every rule loaded
    assert all(r["health"] == "ok" for r in rules), rules
    # (A rule evaluated before the first scrape of the broker sees no `up` for it: BrokerDown is
    # pending for a moment, and resolves at the next evaluation.)
    poll_until(lambda: prometheus.query("ALERTS") == [], timeout=max(1.0, deadline - time.monotonic()), what="no alert")
    exprs = [r["expr"] for g in yaml.safe_load(ALERTS.read_text())["groups"] for r in g["rules"]]
    names = {name for expr in exprs for name in re.findall(r"zmq_rollout_\w+", expr)}
    missing = [n for n in sorted(names) if not prometheus.query(f"count({n})")]
    assert missing == [], f"alerts.yml names series the services do not serve: {missing}"

    # The example queries of docs/metrics.md run and find series.
    docs = (ALERTS.parents[2] / "docs" / "metrics.md").read_text()
    queries = docs.split("```promql\n", 1)[1].split("```", 1)[0].splitlines()
    assert len(queries) >= 5
    for query in queries:
        poll_until(lambda q=query: prometheus.query(q), timeout=max(1.0, deadline - time.monotonic()), what=query)
