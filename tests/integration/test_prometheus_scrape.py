"""The broker's ``/metrics`` scraped by a REAL Prometheus server, queried with PromQL.

test_metrics.py checks the exposition text; this checks that Prometheus itself accepts it:
the target is ``up``, the job counter reads back through PromQL, and a histogram quantile
over the latency buckets is a number. Everything runs on loopback.

Needs ``/usr/bin/prometheus`` (Debian package ``prometheus``; ``.ci/run`` installs it). A
missing binary FAILS the test, so it cannot rot as a skip; set ``ZMQ_ROLLOUT_NO_PROMETHEUS=1``
to skip it deliberately on a machine without it.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import socket
import subprocess
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from zmq_rollout import protocol as p

SKIP_ENV = "ZMQ_ROLLOUT_NO_PROMETHEUS"
JOB = "zmq-rollout-broker"
NUM_PROMPTS = 25
DEADLINE_S = 20.0  # Prometheus start + first scrapes at a 1 s interval take a few seconds


def free_port() -> int:
    """A port free on loopback right now (the OS picks it)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def prometheus_binary() -> str:
    """The Prometheus binary; fails (or skips, if ``ZMQ_ROLLOUT_NO_PROMETHEUS=1``) without one."""
    path = shutil.which("prometheus")
    if path is None and os.access("/usr/bin/prometheus", os.X_OK):
        path = "/usr/bin/prometheus"  # not on PATH (a minimal PATH in CI)
    if path is not None:
        return path
    if os.environ.get(SKIP_ENV) == "1":
        pytest.skip(f"{SKIP_ENV}=1: no Prometheus binary on this machine")
    pytest.fail(
        "the Prometheus binary is missing (no `prometheus` on PATH, no /usr/bin/prometheus). Install it "
        "with `apt-get install -y prometheus` (.ci/run does), or set ZMQ_ROLLOUT_NO_PROMETHEUS=1 to skip "
        "this test deliberately."
    )


class Prometheus:
    """One Prometheus server process on loopback, scraping ``targets`` every second."""

    def __init__(self, binary: str, workdir: Path, targets: list[str]) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        config = workdir / "prometheus.yml"
        config.write_text(
            "global:\n"
            "  scrape_interval: 1s\n"
            "  scrape_timeout: 1s\n"
            "  evaluation_interval: 1s\n"
            "scrape_configs:\n"
            f"  - job_name: {JOB}\n"
            "    static_configs:\n"
            f"      - targets: [{', '.join(repr(t) for t in targets)}]\n"
        )
        self.log_path = workdir / "prometheus.log"
        self._log = self.log_path.open("wb")
        self.process = subprocess.Popen(
            [
                binary,
                f"--config.file={config}",
                f"--storage.tsdb.path={workdir / 'tsdb'}",
                f"--web.listen-address=127.0.0.1:{self.port}",
            ],
            stdout=self._log,
            stderr=subprocess.STDOUT,
            cwd=workdir,
        )

    def log_tail(self, lines: int = 30) -> str:
        self._log.flush()
        return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])

    def _get(self, path: str) -> Any:
        with urllib.request.urlopen(self.url + path, timeout=2) as response:
            return json.loads(response.read()) if path.startswith("/api/") else response.status

    def query(self, promql: str) -> list[dict[str, Any]]:
        """An instant PromQL query; the result vector (empty while nothing matches)."""
        reply = self._get("/api/v1/query?" + urllib.parse.urlencode({"query": promql}))
        assert reply["status"] == "success", reply
        return reply["data"]["result"]  # type: ignore[no-any-return]

    def wait_ready(self, deadline: float) -> None:
        while True:
            if self.process.poll() is not None:
                pytest.fail(f"prometheus exited with {self.process.returncode}:\n{self.log_tail()}")
            try:
                if self._get("/-/ready") == 200:
                    return
            except (urllib.error.URLError, ConnectionError):
                pass
            if time.monotonic() > deadline:
                pytest.fail(f"prometheus was not ready at {self.url} in time:\n{self.log_tail()}")
            time.sleep(0.1)

    def wait_value(self, promql: str, check: Callable[[float], bool], deadline: float) -> float:
        """Poll ``promql`` until it returns exactly one sample whose value passes ``check``."""
        last: Any = None
        while True:
            last = self.query(promql)
            if len(last) == 1 and check(float(last[0]["value"][1])):
                return float(last[0]["value"][1])
            if self.process.poll() is not None or time.monotonic() > deadline:
                pytest.fail(f"PromQL {promql!r} never passed its check; last result {last}\n{self.log_tail()}")
            time.sleep(0.2)

    def stop(self) -> None:
        self.process.terminate()
        try:
            self.process.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait(timeout=5)
        self._log.close()


@pytest.fixture
def start_prometheus(tmp_path: Path) -> Iterator[Callable[[list[str]], Prometheus]]:
    """``start_prometheus(targets)``: a Prometheus server, stopped (terminate, wait) at teardown."""
    started: list[Prometheus] = []

    def start(targets: list[str]) -> Prometheus:
        server = Prometheus(prometheus_binary(), tmp_path, targets)
        started.append(server)
        return server

    yield start
    for server in reversed(started):
        server.stop()


def test_prometheus_scrapes_the_broker(
    start_broker: Any,
    start_double: Any,
    start_client: Any,
    wait_until: Any,
    start_prometheus: Callable[[list[str]], Prometheus],  # last: torn down first
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
