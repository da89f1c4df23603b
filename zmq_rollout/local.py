"""A whole service on one machine: a broker thread plus real vLLM worker processes.

``LocalCluster`` owns everything it starts and stops exactly that; the demo, the examples
and the integration tests use it.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import subprocess
import sys
import time
from typing import IO, Any

from zmq_rollout.broker.server import BrokerThread
from zmq_rollout.config import BrokerConfig, WorkerConfig
from zmq_rollout.errors import RolloutTimeoutError

log = logging.getLogger(__name__)

# Defaults for workers started on this machine (tests, demo). On CPU builds of vLLM the
# memory fraction is of RAM. ZMQ_ROLLOUT_ATTENTION_BACKEND picks the attention backend
# (the GPU test runs set TRITON_ATTN).
LOCAL_WORKER_DEFAULTS: dict[str, Any] = {
    "gpu_memory_utilization": 0.1,
    "max_model_len": 1024,
    "max_num_seqs": 64,
    "attention_backend": os.environ.get("ZMQ_ROLLOUT_ATTENTION_BACKEND") or None,
}


class LocalCluster:
    def __init__(
        self,
        model: str,
        *,
        num_workers: int = 1,
        broker_config: BrokerConfig | None = None,
        worker_overrides: dict[str, Any] | None = None,
        log_dir: str | None = None,
    ) -> None:
        self.model = model
        self.num_workers = num_workers
        self.broker_config = broker_config or BrokerConfig(frontend="tcp://127.0.0.1:*", backend="tcp://127.0.0.1:*")
        self.worker_overrides = {**LOCAL_WORKER_DEFAULTS, **(worker_overrides or {})}
        self.log_dir = log_dir
        self.broker: BrokerThread | None = None
        self.workers: dict[str, subprocess.Popen[bytes]] = {}
        self._logs: list[IO[bytes]] = []

    @property
    def address(self) -> str:
        assert self.broker is not None
        return self.broker.broker.frontend_address

    def start(self, wait: float = 300.0) -> LocalCluster:
        self.broker = BrokerThread(self.broker_config).__enter__()
        for i in range(self.num_workers):
            self.start_worker(f"worker-{i}")
        self.wait_for_workers(self.num_workers, wait)
        return self

    def start_worker(self, name: str) -> subprocess.Popen[bytes]:
        from zmq_rollout.workers.main import cli_args

        assert self.broker is not None
        config = WorkerConfig(
            broker=self.broker.broker.backend_address, model=self.model, name=name, **self.worker_overrides
        )
        out: Any = subprocess.DEVNULL
        if self.log_dir:
            out = open(os.path.join(self.log_dir, f"{name}.log"), "ab")  # noqa: SIM115 - closed in stop()
            self._logs.append(out)
        proc = subprocess.Popen(
            [sys.executable, "-m", "zmq_rollout.cli", "worker", *cli_args(config)],
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        self.workers[name] = proc
        return proc

    def registered(self) -> list[str]:
        assert self.broker is not None
        return [w.info.name for w in list(self.broker.broker.scheduler.workers.values())]

    def wait_for_workers(self, count: int, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while len(self.registered()) < count:
            dead = {n: p.returncode for n, p in self.workers.items() if p.poll() is not None}
            if dead:
                raise RuntimeError(f"worker process(es) exited before registering: {dead}")
            if time.monotonic() > deadline:
                raise RolloutTimeoutError(f"{len(self.registered())} of {count} workers registered after {timeout} s")
            time.sleep(0.2)

    def kill_worker(self, name: str, sig: int = signal.SIGKILL) -> int:
        """Kill a worker's whole process group (the worker and its vLLM engine core)."""
        proc = self.workers[name]
        os.killpg(proc.pid, sig)
        return self.reap(name)

    def reap(self, name: str, timeout: float = 60) -> int:
        """Wait for a worker process that is ending, forget it, return its exit code."""
        proc = self.workers.pop(name)
        code = proc.wait(timeout=timeout)
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)  # leftovers of its group (engine processes)
        return code

    def stop(self) -> None:
        for proc in self.workers.values():
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
        for proc in self.workers.values():
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
        if self.broker is not None:
            self.broker.close()
        for f in self._logs:
            f.close()

    def __enter__(self) -> LocalCluster:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
