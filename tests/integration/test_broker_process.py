"""``LocalCluster(broker_process=True)`` with a REAL vLLM CPU worker: the broker runs in a
process of its own (as ``zmq-rollout broker`` does: packing, its own garbage collector), jobs
go through it to the engine and back, and a restart of that process with jobs running loses
none and runs none twice (the client resubmits; the worker finds the new broker)."""

from __future__ import annotations

import os
import threading
from pathlib import Path

import psutil
import pytest
from helpers import poll_until

from zmq_rollout import RolloutClient, SamplingParams
from zmq_rollout.config import BrokerConfig
from zmq_rollout.local import LocalCluster

BROKER_THREAD = "zmq-rollout-broker"
"""The name of ``BrokerThread``'s thread (broker/server.py)."""


@pytest.fixture(scope="module")
def cluster(tiny_model: str, tmp_path_factory: pytest.TempPathFactory):
    config = BrokerConfig(frontend="tcp://127.0.0.1:*", backend="tcp://127.0.0.1:*", heartbeat_interval_s=0.5)
    logs = tmp_path_factory.mktemp("logs")
    c = LocalCluster(tiny_model, num_workers=1, broker_config=config, log_dir=str(logs), broker_process=True)
    try:
        c.start(wait_s=300)
        yield c
    finally:
        c.stop()


def test_jobs_run_on_a_real_worker_behind_a_broker_process(cluster: LocalCluster, tiny_model: str) -> None:
    assert cluster.broker is None and cluster.broker_proc is not None
    broker = psutil.Process(cluster.broker_proc.pid)
    assert broker.pid != os.getpid() and broker.is_running()
    assert not [t for t in threading.enumerate() if t.name == BROKER_THREAD]  # none in this process
    with RolloutClient(cluster.address) as client:
        rollouts = client.generate([[i + 3, i + 5, 9] for i in range(6)], SamplingParams(max_tokens=5, ignore_eos=True))
    assert [len(r.token_ids) for r in rollouts] == [5] * 6
    assert [r.prompt_token_ids for r in rollouts] == [[i + 3, i + 5, 9] for i in range(6)]
    assert {r.worker_id for r in rollouts} == {"worker-0"}
    totals = cluster.status().totals
    assert totals.completed >= 6 and totals.failed == 0


def test_a_restarted_broker_process_finishes_each_running_job_once(cluster: LocalCluster) -> None:
    """Last in this module: the broker's queues are gone after it."""
    old = cluster.broker_proc
    assert old is not None
    with RolloutClient(cluster.address) as client:
        futures = [
            client.submit([i + 3, i + 9], SamplingParams(max_tokens=200, ignore_eos=True, seed=i)) for i in range(4)
        ]
        poll_until(lambda: cluster.status().running > 0, 60, "jobs to run on the worker")
        cluster.restart_broker()
        assert old.poll() is not None and cluster.broker_proc is not None and cluster.broker_proc.pid != old.pid
        results = [f.result(timeout=300) for f in futures]
    assert [len(r[0].token_ids) for r in results] == [200] * 4
    assert [r[0].prompt_token_ids for r in results] == [[i + 3, i + 9] for i in range(4)]
    cluster.wait_for_workers(1, 120)  # the worker found the new broker process by itself
    totals = cluster.status().totals
    assert 0 < totals.submitted == totals.completed <= 4  # what the new broker got, each once
    log = Path(cluster.log_dir or "", "broker.log").read_text()
    assert log.count("broker up: frontend " + cluster.address) == 2
