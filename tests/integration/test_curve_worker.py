"""A real vLLM worker behind a CurveZMQ broker: refused (and told how to fix it) while its key
is not on the allow-list, let in when the key is added, without a restart of anything, and
then serving jobs over the encrypted connection."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import threading
from pathlib import Path

from helpers import poll_until, scrape

from zmq_rollout import RolloutClient, SamplingParams
from zmq_rollout.broker.server import BrokerThread
from zmq_rollout.config import BrokerConfig, WorkerConfig
from zmq_rollout.curve import generate_keypair
from zmq_rollout.local import LOCAL_WORKER_DEFAULTS
from zmq_rollout.workers.main import worker_command


def test_a_real_worker_is_refused_then_let_in_when_its_key_is_added(tiny_model: str, tmp_path: Path) -> None:
    broker_public, broker_secret = generate_keypair(tmp_path / "broker", "broker")
    allowed = tmp_path / "allowed"
    _, trainer_secret = generate_keypair(allowed, "trainer")
    worker_public, worker_secret = generate_keypair(tmp_path / "pending", "gpu-node")
    thread = BrokerThread(
        BrokerConfig(
            frontend="tcp://127.0.0.1:*",
            backend="tcp://127.0.0.1:*",
            curve_secret_key=str(broker_secret),
            allow_keys=str(allowed),
            metrics_port=0,
            heartbeat_interval_s=0.5,
        )
    )
    front, back, metrics = thread.broker.frontend_address, thread.broker.backend_address, thread.broker.metrics_port
    config = WorkerConfig(
        broker=back,
        model=tiny_model,
        name="gpu-node",
        curve_server_key=str(broker_public),
        curve_secret_key=str(worker_secret),
        heartbeat_interval_s=0.5,
        **LOCAL_WORKER_DEFAULTS,
    )
    lines: list[str] = []
    with thread:
        proc = subprocess.Popen(worker_command(config), stderr=subprocess.PIPE, text=True, start_new_session=True)
        assert proc.stderr is not None
        reader = threading.Thread(target=lambda: lines.extend(proc.stderr), daemon=True)  # type: ignore[arg-type]
        reader.start()
        try:
            poll_until(
                lambda: any("refused this peer's CurveZMQ key" in line for line in lines) or proc.poll() is not None,
                120,
                "the worker to be refused",
            )
            assert proc.poll() is None, "".join(lines[-20:])
            assert scrape(metrics)["zmq_rollout_auth_failures_total{port=backend,reason=key_not_allowed}"] >= 1
            shutil.copy(worker_public, allowed / "gpu-node.key")
            keys = {"curve_server_key": str(broker_public), "curve_secret_key": str(trainer_secret)}
            with RolloutClient(front, timeout_s=90, **keys) as c:
                poll_until(lambda: [w.name for w in c.status().workers] == ["gpu-node"], 60, "the worker to join")
                rollouts = c.generate([[3, 4, 5]] * 4, SamplingParams(max_tokens=6, ignore_eos=True, seed=1))
            assert [(r.worker_id, len(r.token_ids)) for r in rollouts] == [("gpu-node", 6)] * 4
            assert rollouts[0].token_ids == rollouts[3].token_ids  # the same seeded prompt, the same engine
        finally:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(30)
