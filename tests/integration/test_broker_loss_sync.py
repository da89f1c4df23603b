"""The broker dies in the middle of a weight-sync round, with REAL vLLM CPU workers (issue 8).

``LocalCluster.restart_broker`` stops the broker (its round and queues are gone, as when its
process is SIGKILLed) and starts a new one on the same addresses. Each test puts the round
at a known point first, with no sleeps: ``begin`` held open by a job it must drain, or the
first bucket loaded (the workers' weights then partly new). Either way ``update_weights``
raises ``SyncError`` within the client's broker-loss expiry, not at a step's timeout; the
workers serve their old weights or exit 4 and start again from the checkpoint; and the next
``update_weights`` brings every worker to its version.
"""

from __future__ import annotations

import asyncio
import threading
import time
from typing import Any

import pytest
from helpers import poll_until
from model_helpers import SYNC_GREEDY, SYNC_PROMPTS, hf_greedy, trained_model

from zmq_rollout import RolloutClient, SamplingParams, SyncError
from zmq_rollout import protocol as p
from zmq_rollout.config import BrokerConfig
from zmq_rollout.local import LocalCluster
from zmq_rollout.weight_sync import Shipment, SyncRound
from zmq_rollout.weight_sync.shm import ShmTransport

CLIENT = {"heartbeat_interval_s": 0.2, "broker_liveness": 5, "timeout_s": 300}  # the broker is lost after 1 s
EXPIRY_S = 1.0
MARGIN_S = 4.0  # a loaded 2-core machine; the steps' own timeouts are 120 s
WORKERS = ["worker-0", "worker-1"]


@pytest.fixture(scope="module")
def cluster(tiny_model: str, tmp_path_factory: pytest.TempPathFactory):
    config = BrokerConfig(
        frontend="tcp://127.0.0.1:*", backend="tcp://127.0.0.1:*", heartbeat_interval_s=0.5, worker_liveness=10
    )
    c = LocalCluster(tiny_model, num_workers=2, broker_config=config, log_dir=str(tmp_path_factory.mktemp("logs")))
    try:
        c.start(wait_s=300)
        yield c
    finally:
        c.stop()


def sync_in_thread(client: RolloutClient, model: Any, **kwargs: Any) -> tuple[threading.Thread, list[Any]]:
    """``update_weights`` on a thread; its result or exception lands in the returned list."""
    outcome: list[Any] = []

    def run() -> None:
        try:
            outcome.append(client.update_weights(model, timeout_s=120, **kwargs))
        except Exception as exc:
            outcome.append(exc)

    thread = threading.Thread(target=run)
    thread.start()
    return thread, outcome


def failed_promptly(thread: threading.Thread, outcome: list[Any], since: float) -> SyncError:
    thread.join(60)
    assert not thread.is_alive(), "update_weights hung after the broker restarted"
    elapsed = time.monotonic() - since
    (error,) = outcome
    assert isinstance(error, SyncError), error
    assert elapsed < EXPIRY_S + MARGIN_S, f"SyncError came {elapsed:.1f} s after the restart"
    print(f"SyncError {elapsed:.2f} s after the restart: {error}")
    return error


def next_sync_reaches_every_worker(cluster: LocalCluster, client: RolloutClient, model: Any) -> None:
    """The round after the restart succeeds; every worker reports its version in status and
    stamps it on rollouts, whose greedy tokens are the trainer's."""
    report = client.update_weights(model, transport="shm", timeout_s=120)
    assert sorted(report.workers_updated) == WORKERS and report.workers_evicted == []
    status = client.status()
    assert status.fleet_version == report.version
    assert sorted((w.name, w.state, w.weight_version) for w in status.workers) == [
        (name, "ready", report.version) for name in WORKERS
    ]
    rollouts = client.generate(SYNC_PROMPTS, SYNC_GREEDY)
    assert {r.weight_version for r in rollouts} == {report.version}
    assert {r.worker_id for r in rollouts} <= set(WORKERS)
    want = [hf_greedy(model, prompt, SYNC_GREEDY.max_tokens) for prompt in SYNC_PROMPTS]
    same = sum(r.token_ids == want[r.prompt_index] for r in rollouts)
    assert same >= len(SYNC_PROMPTS) - 1, (same, len(SYNC_PROMPTS))  # a bf16 near tie may part one


def test_broker_restarted_while_begin_drains_a_job(cluster: LocalCluster, tiny_model: str) -> None:
    """``pause="wait"``: ``begin`` waits for a long job to finish, so the round is surely in its
    first step when the broker goes. No weight was touched: the workers resume their old
    weights (same greedy tokens as before), none exits, the long job finishes once. The job
    is 16 samples of 1,000 tokens: together they take each other's engine steps, so it runs
    for seconds even on a fast machine (one sample alone once finished before the round began)."""
    model = trained_model(tiny_model, 21)
    with RolloutClient(cluster.address, **CLIENT) as client:
        before = client.generate(SYNC_PROMPTS, SYNC_GREEDY)
        version = client.status().fleet_version
        long = client.submit([5, 6, 7], SamplingParams(n=16, max_tokens=1000, ignore_eos=True))
        poll_until(lambda: cluster.status().running == 1, 60, "the long job to run")
        thread, outcome = sync_in_thread(client, model, transport="shm", pause="wait")
        poll_until(lambda: {w.state for w in cluster.status().workers} == {"syncing"}, 30, "the round to begin")
        assert cluster.status().running == 1, "the long job ended before the restart: begin was not held"
        killed = time.monotonic()
        cluster.restart_broker()
        failed_promptly(thread, outcome, killed)

        cluster.wait_for_workers(2, 60)
        assert all(proc.poll() is None for proc in cluster.workers.values()), "a clean worker exited"
        after = client.generate(SYNC_PROMPTS, SYNC_GREEDY)
        same = sum(a.token_ids == b.token_ids for a, b in zip(after, before, strict=True))
        assert same >= len(SYNC_PROMPTS) - 1, same  # the old weights (a bf16 near tie may part one)
        assert {r.weight_version for r in after} == {version}
        rollouts = long.result(timeout=300)  # resubmitted to the new broker, answered once
        assert [len(r.token_ids) for r in rollouts] == [1000] * 16
        next_sync_reaches_every_worker(cluster, client, model)


class PausedAfterFirstBucket(ShmTransport):
    """shm, which before the second bucket's step tells the test (``loaded``) and waits for it
    to say go (``resume``): the first bucket is then in every worker's weights."""

    def __init__(self) -> None:
        super().__init__()
        self.loaded = threading.Event()
        self.resume = threading.Event()

    async def send(self, rnd: SyncRound, shipment: Shipment) -> None:
        step, loads = rnd.step, 0

        async def held(op: Any) -> p.SyncReply:
            nonlocal loads
            loads += isinstance(op, p.LoadShm)
            if loads == 2 and not self.loaded.is_set():
                self.loaded.set()
                await asyncio.to_thread(self.resume.wait, 120)
            return await step(op)

        rnd.step = held  # type: ignore[method-assign]
        await super().send(rnd, shipment)


def test_broker_restarted_after_the_first_bucket(cluster: LocalCluster, tiny_model: str) -> None:
    """The workers hold one bucket of new weights when the broker goes: no version describes
    them, so each exits 4 (EXIT_WEIGHTS_DIRTY); started again, they load the checkpoint and
    the next round brings them to its version."""
    model = trained_model(tiny_model, 22)
    transport = PausedAfterFirstBucket()
    with RolloutClient(cluster.address, **CLIENT) as client:
        thread, outcome = sync_in_thread(client, model, transport=transport, bucket_bytes=200_000, pause="abort")
        assert transport.loaded.wait(120), "the round never reached its second bucket"
        killed = time.monotonic()
        cluster.restart_broker()
        transport.resume.set()
        failed_promptly(thread, outcome, killed)

        codes = {name: cluster.reap(name, timeout_s=60) for name in WORKERS}
        assert codes == dict.fromkeys(WORKERS, 4), codes  # EXIT_WEIGHTS_DIRTY
        for name in WORKERS:
            cluster.start_worker(name)
        cluster.wait_for_workers(2, 300)
        assert {w.weight_version for w in client.status().workers} == {0}  # the checkpoint
        next_sync_reaches_every_worker(cluster, client, model)
