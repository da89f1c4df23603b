"""``LocalCluster(broker_process=True)`` runs the broker as a process of its own, not a thread
of the caller's: the ports it bound (wildcards too) are read from its output, a client reaches
it, a restart keeps its addresses, ``stop`` ends it, and one that cannot start says why. No engine here
(no workers); tests/integration/test_broker_process.py runs real vLLM workers behind one."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path

import psutil
import pytest
from helpers import scrape

from zmq_rollout.config import BrokerConfig
from zmq_rollout.errors import RolloutTimeoutError
from zmq_rollout.local import LocalCluster


def test_the_broker_runs_in_its_own_process_restarts_on_its_addresses_and_stops(tmp_path: Path) -> None:
    config = BrokerConfig(frontend="tcp://127.0.0.1:*", backend="tcp://127.0.0.1:*", metrics_port=0)
    cluster = LocalCluster(
        "unused-model", num_workers=0, broker_config=config, log_dir=str(tmp_path), broker_process=True
    )
    with cluster:
        assert cluster.broker is None and cluster.broker_proc is not None
        first = cluster.broker_proc
        assert first.pid != os.getpid() and first.poll() is None
        address = cluster.address
        assert not address.endswith(":*")
        command = psutil.Process(first.pid).cmdline()
        assert command[command.index("--frontend") + 1] == "tcp://127.0.0.1:*"  # it picked the port itself
        status = cluster.status()
        assert status.workers == [] and status.queued == 0
        port = cluster.metrics_port
        assert port is not None and port > 0
        assert scrape(port)["zmq_rollout_jobs_total{outcome=submitted}"] == 0

        cluster.restart_broker()
        assert cluster.broker_proc is not None and cluster.broker_proc.pid != first.pid
        assert first.poll() is not None  # the old one ended
        assert cluster.address == address
        assert cluster.status().workers == []  # the client found the new broker at the same address
        second = cluster.broker_proc
    assert second.poll() is not None and cluster.broker_proc is None
    log = (tmp_path / "broker.log").read_text()
    assert log.count("broker up: frontend " + address) == 2, log  # both processes' output, in its log


def test_a_broker_process_that_cannot_bind_says_why(tmp_path: Path) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        config = BrokerConfig(frontend=f"tcp://127.0.0.1:{port}", backend="tcp://127.0.0.1:*")
        cluster = LocalCluster(
            "unused-model", num_workers=0, broker_config=config, log_dir=str(tmp_path), broker_process=True
        )
        with pytest.raises(RuntimeError, match=r"(?s)the broker process exited with code 1 before it served:.*in use"):
            cluster.start()
        assert cluster.broker_proc is None


def test_a_failed_start_stops_the_workers_and_the_broker_it_started(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``with LocalCluster(...)`` calls no ``stop`` when ``start`` raises: ``start`` itself
    stops what it started, or a worker (a session of its own) and the broker would live on."""
    cluster = LocalCluster("unused-model", log_dir=str(tmp_path), broker_process=True)
    started: list[subprocess.Popen[bytes]] = []

    def start_worker(name: str, **_: object) -> subprocess.Popen[bytes]:  # a worker that never registers
        assert cluster.broker_proc is not None
        started.append(cluster.broker_proc)
        proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"], start_new_session=True)
        cluster.workers[name] = proc
        started.append(proc)
        return proc

    monkeypatch.setattr(cluster, "start_worker", start_worker)
    with pytest.raises(RolloutTimeoutError, match="0 of 1 workers registered"):
        cluster.start(wait_s=0.5)
    broker, worker = started
    assert broker.poll() is not None and worker.poll() is not None  # both ended, not left behind
    assert cluster.broker_proc is None
