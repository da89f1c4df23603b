"""Small helpers the tiers share (a module, not tests)."""

from __future__ import annotations

import contextlib
import random
import socket
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import pytest


def ephemeral_ports(path: str = "/proc/sys/net/ipv4/ip_local_port_range") -> tuple[int, int]:
    """The range the kernel takes outgoing connections' local ports (and ``bind(0)``'s) from;
    Linux's default where it cannot be read."""
    try:
        with open(path) as f:
            low, high = (int(x) for x in f.read().split())
    except (OSError, ValueError):
        return 32768, 60999
    return low, high


def free_port(lowest: int = 10_000) -> int:
    """A port free on loopback now that no connection takes meanwhile: a random one below the
    kernel's ephemeral range (``ephemeral_ports``), where only an explicit bind takes a port.
    One the OS picks (``bind(0)``) comes from that range, and any outgoing TCP connection may
    get it as its local port before the process it is for binds it: a vLLM worker binds its
    metrics port after a 40 s engine start and died of 'Address already in use' (a clean clone's
    run of ``test_every_dashboard_query_returns_data_from_a_live_fleet``, seventeenth session).
    Where the range leaves no room below it, the OS picks."""
    low, _ = ephemeral_ports()
    rng = random.Random()
    for _ in range(200 if low - lowest >= 1000 else 0):
        port = rng.randrange(lowest, low)
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
            try:
                sock.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


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


def scrape(port: int) -> dict[str, float]:
    """The samples of the ``/metrics`` endpoint on ``port`` (``parse_samples``)."""
    import urllib.request

    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as response:
        return parse_samples(response.read().decode())


def parse_samples(text: str) -> dict[str, float]:
    """The samples of an exposition text, keyed ``name`` or ``name{label=value,...}`` (labels sorted)."""
    from prometheus_client.parser import text_string_to_metric_families

    out = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            labels = ",".join(f"{k}={v}" for k, v in sorted(s.labels.items()))
            out[f"{s.name}{{{labels}}}" if labels else s.name] = s.value
    return out


# -- metric naming (docs/metrics.md, "Conventions") ---------------------------------------
PREFIXES = ("zmq_rollout_", "vllm:")
NON_BASE_UNITS = {
    *("ms", "millis", "milliseconds", "us", "micros", "microseconds", "ns", "nanoseconds", "minutes", "hours", "days"),
    *("kb", "kib", "mb", "mib", "gb", "gib", "kilobytes", "megabytes", "gigabytes", "percent", "pct", "perc"),
}
DURATION_WORDS = {"latency", "duration", "time", "wait", "age", "delay", "elapsed", "timeout", "seconds"}
SIZE_WORDS = {"size", "bytes"}
HISTOGRAM_UNITS = ("_seconds", "_bytes", "_versions")
"""A histogram is of a duration, a size, or (dimensionless) weight versions, and says which."""
ID_LABELS = {"id", "ids", "uuid", "ticket", "tickets", "identity", "job", "request", "key"}


def metric_name_problems(text: str) -> list[str]:
    """What in an exposition text breaks our metric conventions: a name outside ``zmq_rollout_``
    (and vLLM's ``vllm:``), a counter without ``_total`` (or another type with it), a non-base
    unit, a duration not in seconds, a size not in bytes, a histogram not in seconds, bytes or
    versions, a label that names an id (unbounded). vLLM's names are its own: of its families
    only the labels are checked. ``*_created`` families are prometheus_client's timestamps."""
    import re

    from prometheus_client.parser import text_string_to_metric_families

    problems = []
    for name, kind in re.findall(r"^# TYPE (\S+) (\S+)$", text, re.MULTILINE):
        if not name.startswith(PREFIXES):
            problems.append(f"{name}: not named zmq_rollout_* (or vllm:*)")
        if name.startswith("vllm:") or (name.endswith("_created") and kind == "gauge"):
            continue
        if kind == "counter" and not name.endswith("_total"):
            problems.append(f"{name}: a counter not ending in _total")
        if kind != "counter" and name.endswith("_total"):
            problems.append(f"{name}: a {kind} ending in _total (only counters do)")
        base = name.removesuffix("_total")
        words = set(base.split("_"))
        if words & NON_BASE_UNITS:
            units = ", ".join(sorted(words & NON_BASE_UNITS))
            problems.append(f"{name}: a non-base unit ({units}; use seconds, bytes, ratios)")
        if words & DURATION_WORDS and not base.endswith("_seconds"):
            problems.append(f"{name}: a duration not in seconds (end it in _seconds)")
        if words & SIZE_WORDS and not base.endswith("_bytes"):
            problems.append(f"{name}: a size not in bytes (end it in _bytes)")
        if kind in ("histogram", "summary") and not base.endswith(HISTOGRAM_UNITS):
            problems.append(f"{name}: a {kind} not in {', '.join(u[1:] for u in HISTOGRAM_UNITS)}")
    for family in text_string_to_metric_families(text):
        labels = sorted({label for s in family.samples for label in s.labels} - {"le", "quantile"})
        problems.extend(
            f"{family.name}: label {label!r} names an id (unbounded series)"
            for label in labels
            if label in ID_LABELS or label.endswith(("_id", "_ids", "_uuid", "_ticket"))
        )
    return problems


@contextlib.contextmanager
def running_gateway(broker: str, **overrides: Any) -> Iterator[str]:
    """``zmq-rollout gateway`` for the broker at ``broker`` (``GatewayConfig`` overrides), under
    uvicorn on a thread, on a free loopback port: yields its base URL, stops it after."""
    import uvicorn

    from zmq_rollout.gateway import GatewayConfig
    from zmq_rollout.gateway.app import create_app

    config = GatewayConfig(broker=broker, port=0, **overrides)
    server = uvicorn.Server(uvicorn.Config(create_app(config), host="127.0.0.1", port=0, log_level="warning"))
    thread = threading.Thread(target=server.run, name="gateway", daemon=True)
    thread.start()
    try:
        poll_until(lambda: server.started, timeout=30, what="the gateway to start")
        yield f"http://127.0.0.1:{server.servers[0].sockets[0].getsockname()[1]}"
    finally:
        server.should_exit = True
        thread.join(timeout=10)


@contextlib.contextmanager
def local_cluster(model: str, logs: Any, num_workers: int, **broker: Any) -> Iterator[Any]:
    """A ``LocalCluster`` of real CPU vLLM workers on loopback ports (``BrokerConfig``
    overrides in ``broker``; worker logs in the folder ``logs``), started, stopped after."""
    from zmq_rollout.config import BrokerConfig
    from zmq_rollout.local import LocalCluster

    config = BrokerConfig(frontend="tcp://127.0.0.1:*", backend="tcp://127.0.0.1:*", **broker)
    cluster = LocalCluster(model, num_workers=num_workers, broker_config=config, log_dir=str(logs))
    try:
        cluster.start(wait_s=300)
        yield cluster
    finally:
        cluster.stop()
