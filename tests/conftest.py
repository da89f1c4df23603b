"""Shared pytest fixtures, one section per concern."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import pytest
import zmq

from zmq_rollout.broker.scheduler import Scheduler
from zmq_rollout.broker.server import BrokerThread
from zmq_rollout.broker.stats import BrokerStats
from zmq_rollout.client import RolloutClient
from zmq_rollout.config import BrokerConfig
from zmq_rollout.testing import EchoWorkerDouble

# =========================================================================================
# Broker / client fixtures: loopback brokers, echo worker doubles, blocking clients.
# Every fixture here is a factory that keeps a handle to what it started and stops exactly
# those at teardown (clients, then doubles, then brokers).
# =========================================================================================

LOOPBACK = "tcp://127.0.0.1:*"


def poll_until(predicate: Callable[[], Any], timeout: float = 5.0, what: str = "condition") -> Any:
    """Poll ``predicate`` until it returns something truthy; fail the test after ``timeout``."""
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            pytest.fail(f"timed out after {timeout} s waiting for {what}")
        time.sleep(0.005)


@pytest.fixture
def wait_until() -> Callable[..., Any]:
    """``wait_until(predicate, timeout=5.0, what="...")``: poll with a deadline."""
    return poll_until


@dataclass
class RunningBroker:
    """A ``BrokerThread`` on loopback, with the addresses it bound (read before it started)."""

    thread: BrokerThread
    frontend: str
    backend: str

    @property
    def scheduler(self) -> Scheduler:
        return self.thread.broker.scheduler

    @property
    def stats(self) -> BrokerStats:
        return self.thread.broker.scheduler.stats

    def has_worker(self, name: str) -> bool:
        return any(w.info.name == name for w in list(self.scheduler.workers.values()))


@pytest.fixture
def start_broker() -> Iterator[Callable[..., RunningBroker]]:
    """``start_broker(**BrokerConfig overrides)``: a broker thread on random loopback ports.

    Defaults: heartbeat every 0.1 s, worker expiry 1 s (generous: every thread of the test
    shares one GIL on a small machine, and a spurious expiry would requeue jobs).
    """
    started: list[BrokerThread] = []

    def start(**overrides: Any) -> RunningBroker:
        settings: dict[str, Any] = {
            "frontend": LOOPBACK,
            "backend": LOOPBACK,
            "heartbeat_interval": 0.1,
            "worker_liveness": 10,
        }
        settings.update(overrides)
        thread = BrokerThread(BrokerConfig(**settings))
        # Read the endpoints before the loop thread owns the sockets (they are not thread-safe).
        running = RunningBroker(thread, thread.broker.frontend_address, thread.broker.backend_address)
        thread.__enter__()
        started.append(thread)
        return running

    yield start
    for thread in reversed(started):
        thread.close()


@pytest.fixture
def start_double(start_broker: Any) -> Iterator[Callable[..., EchoWorkerDouble]]:
    """``start_double(broker, **EchoWorkerDouble options)``: an echo worker double, started
    and (by default) registered with the broker before it returns."""
    doubles: list[EchoWorkerDouble] = []

    def start(broker: RunningBroker, *, registered: bool = True, **options: Any) -> EchoWorkerDouble:
        options.setdefault("heartbeat", 0.05)
        double = EchoWorkerDouble(broker.backend, **options)
        double.start()
        doubles.append(double)
        if registered:
            poll_until(lambda: broker.has_worker(double.name), what=f"worker {double.name} to register")
        return double

    yield start
    for double in reversed(doubles):
        double.stop()


@pytest.fixture
def raw_socket() -> Iterator[Callable[[int], zmq.Socket[Any]]]:
    """``raw_socket(zmq.DEALER)``: a bare socket (linger 0) for speaking the wire by hand."""
    sockets: list[zmq.Socket[Any]] = []

    def make(kind: int) -> zmq.Socket[Any]:
        sock = zmq.Context.instance().socket(kind)
        sock.setsockopt(zmq.LINGER, 0)
        sockets.append(sock)
        return sock

    yield make
    for sock in sockets:
        sock.close(linger=0)


@pytest.fixture
def start_client(start_broker: Any) -> Iterator[Callable[..., RolloutClient]]:
    """``start_client(address, **ClientConfig overrides)``: a blocking client, closed at the end."""
    clients: list[RolloutClient] = []

    def start(address: str, **overrides: Any) -> RolloutClient:
        client = RolloutClient(address, **overrides)
        clients.append(client)
        return client

    yield start
    for client in reversed(clients):
        client.close()


# =========================================================================================
# Models: a tiny Qwen2 written to disk once per test module (the weight-sync modules).
# =========================================================================================
@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    from zmq_rollout.tiny_model import make_tiny_model

    return str(make_tiny_model(tmp_path_factory.mktemp("model") / "tiny-qwen2"))
