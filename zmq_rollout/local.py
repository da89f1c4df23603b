"""A whole service on one machine: a broker (a thread, or a process of its own) plus real vLLM
worker processes.

``LocalCluster`` owns everything it starts and stops exactly that; the demo, the examples
and the integration tests use it. It watches the broker the way any user can, through a
client's ``status()``, never by reading the broker's state from another thread. The
services (broker, workers) are imported when a cluster starts, not with this module.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import logging
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from typing import IO, TYPE_CHECKING, Any

from zmq_rollout import protocol as p
from zmq_rollout.blocking import RolloutClient
from zmq_rollout.config import BrokerConfig, WorkerConfig
from zmq_rollout.errors import RolloutTimeoutError

if TYPE_CHECKING:
    from zmq_rollout.broker.server import BrokerThread

log = logging.getLogger(__name__)

# Defaults for workers started on this machine (tests, demo). The KV cache is sized
# explicitly: engines that share a device then start together reliably (vLLM's memory
# profiling would count the others' memory as its own), and on a CPU it is a small slice
# of RAM, not a fraction of it per engine. ZMQ_ROLLOUT_ATTENTION_BACKEND picks the
# attention backend (the GPU runs set TRITON_ATTN).
LOCAL_WORKER_DEFAULTS: dict[str, Any] = {
    "gpu_memory_utilization": 0.1,
    "kv_cache_gib": 0.25,
    "max_model_len": 1024,
    "max_num_seqs": 64,
    "attention_backend": os.environ.get("ZMQ_ROLLOUT_ATTENTION_BACKEND") or None,
}


def wait_until_free(addresses: list[str], timeout_s: float) -> None:
    """Until each ``tcp://host:port`` can be bound again. ZeroMQ closes a socket's listener on
    its I/O thread, a moment after ``close()`` returns; binding at once may find it in use."""
    deadline = time.monotonic() + timeout_s
    for address in addresses:
        host, _, port = address.removeprefix("tcp://").rpartition(":")
        host = "0.0.0.0" if host == "*" else host.strip("[]")
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        while True:
            with socket.socket(family) as probe:
                probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as ZeroMQ binds
                try:
                    probe.bind((host, int(port)))
                    break
                except OSError:
                    if time.monotonic() > deadline:
                        raise
            time.sleep(0.01)


BROKER_START_S = 60.0
"""How long a broker process may take to serve (imports and binding take about a second)."""
BROKER_UP = re.compile(rb"broker up: frontend (\S+), backend (\S+), metrics port (\S+)")
"""The line a broker logs once it is bound and serving (``Broker.run``)."""


class BrokerOutput:
    """A broker process's output, read on a thread: copied to its log (if any), its last
    lines kept for an error, and its "up" line's addresses (the ports it bound, wildcards
    too) once it serves. ``wait_up`` returns them, or raises if it exits or takes too long."""

    def __init__(self, proc: subprocess.Popen[bytes], log: IO[bytes] | None, keep: int = 12) -> None:
        self.proc = proc
        self.log = log
        self.last: collections.deque[str] = collections.deque(maxlen=keep)
        self.up: tuple[str, str, int | None] | None = None
        self._seen = threading.Event()
        self._thread = threading.Thread(target=self._read, name="broker-output", daemon=True)
        self._thread.start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            if self.log is not None:
                self.log.write(line)
                self.log.flush()
            self.last.append(line.decode("utf-8", "replace").rstrip()[:300])
            if self.up is None and (found := BROKER_UP.search(line)):
                frontend, backend, port = (part.decode() for part in found.groups())
                self.up = (frontend, backend, None if port == "None" else int(port))
                self._seen.set()
        self._seen.set()  # its output ended: it exited

    def wait_up(self, timeout_s: float) -> tuple[str, str, int | None]:
        if not self._seen.wait(timeout_s):
            raise RolloutTimeoutError(f"the broker process did not start serving within {timeout_s} s")
        if self.up is None:
            code = self.proc.wait()
            raise RuntimeError(f"the broker process exited with code {code} before it served:\n" + "\n".join(self.last))
        return self.up

    def join(self, timeout_s: float = 10.0) -> None:
        self._thread.join(timeout_s)


def start_nicer(argv: list[str], niceness: int, **popen: Any) -> subprocess.Popen[bytes]:
    """Start ``argv`` as the leader of a process group of its own (``os.killpg(proc.pid, ...)``
    ends it and the engine processes it starts) in the caller's session, ``niceness`` below the
    caller's priority, set before it starts its children (an engine process, seconds of imports
    away), which inherit it.

    In the caller's session, not a new one: with the kernel's autogroups each session shares the
    CPU as one group, whatever its processes' nice values. Two workers in sessions of their own
    competed as wholes, and on 2 cores one worker's session (its engine included) got no CPU
    for 2-7 s while the other's engine ran (docs/architecture.md, "A late loop"). In one group the
    nice value counts as it says. Lowering the priority is best effort."""
    group: dict[str, Any] = {"process_group": 0} if sys.version_info >= (3, 11) else {"preexec_fn": os.setpgrp}
    proc: subprocess.Popen[bytes] = subprocess.Popen(argv, **group, **popen)
    if niceness:
        with contextlib.suppress(OSError):
            os.setpriority(os.PRIO_PROCESS, proc.pid, min(19, os.getpriority(os.PRIO_PROCESS, 0) + niceness))
    return proc


_CAUSES = ("Fatal Python error", "died unexpectedly", "Error: ", "Killed", "Traceback")
"""Words of a log line that tells why a process died: a crash (faulthandler), an engine's
worker process gone (vLLM's executor), an exception's last line, the OOM killer."""


def log_excerpt(path: str, tail: int = 12, causes: int = 6, width: int = 300) -> str:
    """The lines of a dead process's log that tell why: its first ``causes`` lines with words of
    ``_CAUSES``, then its last ``tail`` lines (each cut at ``width`` characters); a note if the
    log cannot be read."""
    try:
        with open(path, "rb") as f:
            lines = [line.decode("utf-8", "replace").rstrip() for line in f.read().splitlines()]
    except OSError as exc:
        return f"(no log: {exc.strerror})"
    lines = [line for line in lines if line.strip()]
    last = lines[-tail:]
    found = [line for line in lines[: len(lines) - len(last)] if any(c in line for c in _CAUSES)][:causes]
    picked = [*found, *(["..."] if found else []), *last]
    return "\n".join(line[:width] for line in picked)


class LocalCluster:
    def __init__(
        self,
        model: str,
        *,
        num_workers: int = 1,
        broker_config: BrokerConfig | None = None,
        worker_overrides: dict[str, Any] | None = None,
        log_dir: str | None = None,
        worker_niceness: int = 10,
        broker_process: bool = False,
    ) -> None:
        """``worker_niceness``: the workers run this much nicer than this process. On one
        machine the engines busy-spin on every core; at equal priority the broker (a thread
        here) and the clients get the CPU seconds late, and with it heartbeats, sync steps and
        streamed tokens. 0: same priority.

        ``broker_process``: run the broker as a process of its own (``zmq-rollout broker``,
        with that command's defaults: packing, and polling without sleeping while a core is
        spare), not as a thread of this one. A thread shares this process's GIL and its
        garbage collector: a trainer with a large heap stops the broker, and with it every
        worker's next job, for each full collection (0.46 s once in ``benchmarks/gpu_e2e.py``).
        Its output goes to ``log_dir``/broker.log; the ports it bound (wildcards too) are read
        from its "broker up" line."""
        self.model = model
        self.num_workers = num_workers
        self.broker_config = broker_config or BrokerConfig(frontend="tcp://127.0.0.1:*", backend="tcp://127.0.0.1:*")
        self.worker_overrides = {**LOCAL_WORKER_DEFAULTS, **(worker_overrides or {})}
        self.log_dir = log_dir
        self.worker_niceness = worker_niceness
        self.broker_process = broker_process
        self.broker: BrokerThread | None = None
        """The broker's thread (None with ``broker_process``: see ``broker_proc``)."""
        self.broker_proc: subprocess.Popen[bytes] | None = None
        """The broker's process, with ``broker_process``."""
        self._broker_output: BrokerOutput | None = None
        self._metrics_port: int | None = None
        self.workers: dict[str, subprocess.Popen[bytes]] = {}
        self._logs: list[IO[bytes]] = []
        self._client: RolloutClient | None = None
        self._endpoints = ("", "")

    @property
    def _serving(self) -> bool:
        """Whether a broker (its thread or its process) was started and not stopped."""
        return self.broker is not None or self.broker_proc is not None

    @property
    def address(self) -> str:
        """The broker's frontend (clients connect here)."""
        assert self._serving, "start() first"
        return self._endpoints[0]

    def _start_broker(self, config: BrokerConfig) -> None:
        if self.broker_process:
            self._start_broker_process(config)
            return
        from zmq_rollout.broker.server import BrokerThread

        thread = BrokerThread(config)
        # Read before the broker's thread owns its sockets (they are not thread-safe).
        self._endpoints = (thread.broker.frontend_address, thread.broker.backend_address)
        self._metrics_port = thread.broker.metrics_port
        self.broker = thread.__enter__()

    def _start_broker_process(self, config: BrokerConfig) -> None:
        from zmq_rollout.settings import to_argv

        log: IO[bytes] | None = None
        if self.log_dir:
            log = open(os.path.join(self.log_dir, "broker.log"), "ab")  # noqa: SIM115 - closed in stop()
            self._logs.append(log)
        command = [sys.executable, "-m", "zmq_rollout.cli", "broker", *to_argv(config)]
        proc = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True)
        self.broker_proc, self._broker_output = proc, BrokerOutput(proc, log)
        try:
            frontend, backend, self._metrics_port = self._broker_output.wait_up(BROKER_START_S)
        except (RuntimeError, RolloutTimeoutError):
            self._stop_broker()
            raise
        self._endpoints = (frontend, backend)

    def _stop_broker(self) -> None:
        if self.broker is not None:
            self.broker.close()
            self.broker = None
        proc, self.broker_proc = self.broker_proc, None
        if proc is not None:
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)  # the broker closes its sockets and exits
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
            if self._broker_output is not None:
                self._broker_output.join()  # its last lines are in its log before the log closes

    @property
    def metrics_port(self) -> int | None:
        """The broker's ``/metrics`` port, if ``broker_config.metrics_port`` asked for one."""
        assert self._serving, "start() first"
        return self._metrics_port

    def start(self, wait_s: float = 300.0) -> LocalCluster:
        """Start the broker and the workers; wait until every worker registered. If any of it
        fails, what did start is stopped before the error goes on: no worker (each in a session
        of its own) or broker process outlives a failed start (``with`` calls no ``stop`` then)."""
        try:
            self._start_broker(self.broker_config)
            self._client = RolloutClient(self.address, name="local-cluster")
            for i in range(self.num_workers):
                self.start_worker(f"worker-{i}")
            self.wait_for_workers(self.num_workers, wait_s)
        except BaseException:
            self.stop()
            raise
        return self

    def restart_broker(self) -> None:
        """Stop the broker (its queues are lost, as when its process dies) and start a new one
        on the same addresses; clients and workers find it by themselves."""
        assert self._serving, "start() first"
        frontend, backend = self._endpoints
        self._stop_broker()
        wait_until_free([frontend, backend], 10.0)
        self._start_broker(dataclasses.replace(self.broker_config, frontend=frontend, backend=backend))

    def start_worker(self, name: str, **overrides: Any) -> subprocess.Popen[bytes]:
        """Start worker ``name`` (``WorkerConfig`` fields in ``overrides`` beside the cluster's,
        e.g. its own ``metrics_port``, or ``gpus="0,1"`` for one process of two engines)."""
        from zmq_rollout.workers.main import worker_command

        assert self._serving, "start() first"
        settings = {**self.worker_overrides, **overrides}
        config = WorkerConfig(broker=self._endpoints[1], model=self.model, name=name, **settings)
        out: Any = subprocess.DEVNULL
        if self.log_dir:
            out = open(os.path.join(self.log_dir, f"{name}.log"), "ab")  # noqa: SIM115 - closed in stop()
            self._logs.append(out)
        proc = start_nicer(worker_command(config), self.worker_niceness, stdout=out, stderr=subprocess.STDOUT)
        self.workers[name] = proc
        return proc

    def status(self) -> p.StatusReply:
        """The broker's STATUS_REPLY."""
        assert self._client is not None, "start() first"
        return self._client.status()

    def registered(self) -> list[str]:
        """Names of the workers registered with the broker."""
        return [w.name for w in self.status().workers]

    def wait_for_workers(self, count: int, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while len(self.registered()) < count:
            dead = {n: proc.returncode for n, proc in self.workers.items() if proc.poll() is not None}
            if dead:
                raise RuntimeError(f"worker process(es) exited before registering: {dead}{self._logs_of(dead)}")
            if time.monotonic() > deadline:
                raise RolloutTimeoutError(f"{len(self.registered())} of {count} workers registered after {timeout_s} s")
            time.sleep(0.2)

    def _logs_of(self, names: dict[str, int]) -> str:
        """What the logs of ``names`` say of their end (for the error that reports them), or
        where to look: without a ``log_dir`` their output went nowhere."""
        if not self.log_dir:
            return " (start the cluster with log_dir=... to keep the workers' output)"
        paths = {name: os.path.join(self.log_dir, f"{name}.log") for name in names}
        return "".join(f"\n--- {name}: {path} ---\n{log_excerpt(path)}" for name, path in paths.items())

    def kill_worker(self, name: str, sig: int = signal.SIGKILL) -> int:
        """Kill a worker's whole process group (the worker and its vLLM engine core)."""
        proc = self.workers[name]
        os.killpg(proc.pid, sig)
        return self.reap(name)

    def reap(self, name: str, timeout_s: float = 60) -> int:
        """Wait for a worker process that is ending, forget it, return its exit code."""
        proc = self.workers.pop(name)
        code = proc.wait(timeout=timeout_s)
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
        if self._client is not None:
            self._client.close()
        self._stop_broker()
        for f in self._logs:
            f.close()

    def __enter__(self) -> LocalCluster:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
