"""Fixtures every tier shares, and the tiers themselves.

Tiers are folders: ``unit`` (no vLLM engine, no sleeps; the edit loop, ``scripts/test.sh
--fast``), ``integration`` (real vLLM CPU workers, a real Prometheus, the wheel), ``gpu``
(a CUDA GPU; run through the device tool, ``benchmarks/gpu/run_gpu_e2e.sh``). Each test is
marked with its tier, so ``-m`` selects across folders.
"""

from __future__ import annotations

import contextlib
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import zmq
from helpers import poll_until, running_gateway, scrape

from zmq_rollout import codec
from zmq_rollout import protocol as p
from zmq_rollout.blocking import RolloutClient
from zmq_rollout.broker.server import BrokerThread
from zmq_rollout.config import BrokerConfig
from zmq_rollout.curve import PeerKeys
from zmq_rollout.testing import EchoWorkerDouble

TIERS = ("unit", "integration", "gpu")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    here = Path(__file__).parent
    cuda = None
    for item in items:
        tier = Path(item.fspath).relative_to(here).parts[0]
        if tier not in TIERS:
            raise pytest.UsageError(f"{item.nodeid}: a test lives in one of the tier folders {TIERS}")
        item.add_marker(getattr(pytest.mark, tier))
        if tier == "gpu":
            if cuda is None:
                import torch

                cuda = torch.cuda.is_available()
            if not cuda:
                item.add_marker(pytest.mark.skip(reason="needs a CUDA GPU: the GPU tier runs on the device machine"))


@pytest.fixture
def wait_until() -> Callable[..., Any]:
    """``wait_until(predicate, timeout=5.0, what="...")``: poll with a deadline."""
    return poll_until


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> str:
    """The tiny random-weight Qwen2 (``zmq-rollout make-tiny-model``), written once per session."""
    from zmq_rollout.tiny_model import make_tiny_model

    return str(make_tiny_model(tmp_path_factory.mktemp("model") / "tiny-qwen2"))


# =========================================================================================
# Loopback brokers, echo worker doubles, blocking clients. Every fixture here is a factory
# that keeps a handle to what it started and stops exactly those at teardown (clients, then
# doubles, then brokers). Tests observe a running broker only as a user can, from outside
# its thread: STATUS over the wire and its /metrics.
# =========================================================================================

LOOPBACK = "tcp://127.0.0.1:*"
_to_client = codec.Decoder(codec.TO_CLIENT)


@dataclass
class RunningBroker:
    """A ``BrokerThread`` on loopback, with the addresses it bound (read before it started)."""

    thread: BrokerThread
    frontend: str
    backend: str
    metrics_port: int
    curve: PeerKeys | None = None
    """Keys to ask STATUS with, for a broker that requires CurveZMQ."""

    def status(self) -> p.StatusReply:
        """STATUS over a fresh DEALER, as any client asks."""
        sock = zmq.Context.instance().socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        if self.curve is not None:
            self.curve.apply(sock)
        sock.setsockopt(zmq.IDENTITY, f"status-probe-{uuid.uuid4().hex[:8]}".encode())
        try:
            sock.connect(self.frontend)
            sock.send_multipart(codec.encode(p.STATUS))
            while sock.poll(5000):
                msg = _to_client.decode(sock.recv_multipart())
                if msg.command == p.STATUS_REPLY:
                    sock.send_multipart(codec.encode(p.DISCONNECT))  # leave no client record behind
                    return msg.body  # type: ignore[no-any-return]
            pytest.fail("the broker did not answer STATUS within 5 s")
        finally:
            sock.close(linger=1000)

    def metrics(self) -> dict[str, float]:
        """Its ``/metrics`` samples (``helpers.scrape``)."""
        return scrape(self.metrics_port)

    def jobs(self, outcome: str) -> int:
        """``zmq_rollout_jobs_total{outcome}``."""
        return int(self.metrics().get(f"zmq_rollout_jobs_total{{outcome={outcome}}}", 0))

    def malformed(self) -> dict[str, int]:
        """``zmq_rollout_malformed_messages_total`` by reason, the reasons counted so far (every
        reason is exported from 0: ``test_metrics.py`` checks that)."""
        prefix = "zmq_rollout_malformed_messages_total{reason="
        return {k[len(prefix) : -1]: int(v) for k, v in self.metrics().items() if k.startswith(prefix) and v}

    def has_worker(self, name: str) -> bool:
        return any(w.name == name for w in self.status().workers)


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
            "heartbeat_interval_s": 0.1,
            "worker_liveness": 10,
            "metrics_port": 0,
            "metrics_host": "127.0.0.1",
        }
        settings.update(overrides)
        thread = BrokerThread(BrokerConfig(**settings))
        # Read the endpoints before the loop thread owns the sockets (they are not thread-safe).
        broker = thread.broker
        running = RunningBroker(thread, broker.frontend_address, broker.backend_address, broker.metrics_port or 0)
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


@pytest.fixture
def start_gateway() -> Iterator[Callable[..., str]]:
    """``start_gateway(frontend, **GatewayConfig overrides)``: the gateway on a uvicorn thread,
    on a free loopback port (``helpers.running_gateway``); returns its base URL. Stopped at
    teardown."""
    with contextlib.ExitStack() as stack:
        yield lambda frontend, **overrides: stack.enter_context(running_gateway(frontend, **overrides))
