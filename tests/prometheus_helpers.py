"""A real Prometheus server for the integration tests (a module of helpers, not tests).

Needs ``/usr/bin/prometheus`` (Debian package ``prometheus``; ``.ci/run`` installs it). A
missing binary FAILS the test that asks for one, so it cannot rot as a skip; set
``ZMQ_ROLLOUT_NO_PROMETHEUS=1`` to skip deliberately on a machine without it.

A test module takes the fixture by importing it: ``from prometheus_helpers import
start_prometheus_fixture  # noqa: F401`` (it is named ``start_prometheus``).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from helpers import free_port

SKIP_ENV = "ZMQ_ROLLOUT_NO_PROMETHEUS"
JOB = "zmq-rollout-broker"


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
        "with `apt-get install -y prometheus` (scripts/test.sh does), or set ZMQ_ROLLOUT_NO_PROMETHEUS=1 to skip "
        "this test deliberately."
    )


class Prometheus:
    """One Prometheus server process on loopback, scraping ``targets`` every second (a list:
    the broker's job; a dict: job name -> targets), each job's targets labelled ``component``
    (the job name's last word, as deploy/prometheus/prometheus.yml does), and evaluating
    ``rule_files`` every second."""

    def __init__(
        self,
        binary: str,
        workdir: Path,
        targets: list[str] | dict[str, list[str]],
        rule_files: list[Path] | None = None,
    ) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        config = workdir / "prometheus.yml"
        jobs = targets if isinstance(targets, dict) else {JOB: targets}
        config.write_text(
            "global:\n"
            "  scrape_interval: 1s\n"
            "  scrape_timeout: 1s\n"
            "  evaluation_interval: 1s\n"
            f"rule_files: [{', '.join(repr(str(f)) for f in rule_files or [])}]\n"
            "scrape_configs:\n"
            + "".join(
                f"  - job_name: {job}\n"
                "    static_configs:\n"
                f"      - targets: [{', '.join(repr(t) for t in job_targets)}]\n"
                f"        labels: {{component: {job.rsplit('-', 1)[-1]}}}\n"
                for job, job_targets in jobs.items()
            )
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


@pytest.fixture(name="start_prometheus")
def start_prometheus_fixture(tmp_path: Path) -> Iterator[Callable[..., Prometheus]]:
    """``start_prometheus(targets, rule_files=None)``: a Prometheus server (see ``Prometheus``),
    stopped (terminate, wait) at teardown."""
    started: list[Prometheus] = []

    def start(targets: list[str] | dict[str, list[str]], rule_files: list[Path] | None = None) -> Prometheus:
        workdir = tmp_path / f"prometheus-{len(started)}"
        workdir.mkdir()
        server = Prometheus(prometheus_binary(), workdir, targets, rule_files)
        started.append(server)
        return server

    yield start
    for server in reversed(started):
        server.stop()
