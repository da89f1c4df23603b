"""A worker's late-waking event loop (``workers/loop_watch.py``): when a wake counts as a
stall, what the stall says of its cause, and what the worker does with it (logs it, counts it
in its metrics, and does not count the silence against the broker)."""

from __future__ import annotations

import asyncio
import logging
import os
from types import SimpleNamespace

import pytest
from helpers import parse_samples
from prometheus_client import generate_latest

from zmq_rollout.config import WorkerConfig
from zmq_rollout.workers import worker as worker_module
from zmq_rollout.workers.loop_watch import SCHEDSTAT, LoopWatch, Stall, runqueue_seconds
from zmq_rollout.workers.metrics import WorkerMetrics


class Meter:
    """A stand-in for a process clock (CPU or collector seconds), set by the test."""

    def __init__(self) -> None:
        self.value = 0.0

    def __call__(self) -> float:
        return self.value


def test_a_wake_over_one_interval_and_a_second_late_is_a_stall_measured_from_the_last_wake() -> None:
    cpu, gc, rq = Meter(), Meter(), Meter()
    watch = LoopWatch(1.0, 100.0, cpu=cpu, gc=gc, runqueue=rq)
    assert watch.woke(101.0) is None  # on time
    assert watch.woke(104.0) is None  # 2 s late: the limit, not past it
    cpu.value, gc.value, rq.value = 0.3, 0.1, 4.0
    assert watch.woke(109.5) == Stall(4.5, 0.3, 0.1, 4.0)  # 5.5 s since the last wake: 4.5 past its interval...
    assert watch.woke(110.5) is None  # ... and the next wake is measured from this one
    cpu.value = 3.3
    assert watch.woke(115.5) == Stall(4.0, 3.0, 0.0, 0.0)  # CPU, collector and wait since the last wake only


def test_without_schedstat_a_stall_has_no_wait() -> None:
    watch = LoopWatch(1.0, 0.0, cpu=Meter(), gc=Meter(), runqueue=lambda: None)
    assert watch.woke(5.0) == Stall(4.0, 0.0, 0.0, None)


def test_a_stall_names_its_cause_from_the_wait_for_a_core_then_the_cpu() -> None:
    starved = Stall(4.6, 0.1, 0.0, 4.5)
    assert starved.cause == "starved" and str(starved) == (
        "event loop stalled for 4.6 s (starved: it waited for a core while other processes held them; "
        "meanwhile the process used 0.1 s of CPU, 0.0 s in garbage collection, waited 4.5 s for a core)"
    )
    busy = Stall(3.0, 2.9, 2.5, 0.1)
    assert busy.cause == "busy" and "(busy: this process ran; meanwhile the process used 2.9 s of CPU, 2.5 s in" in str(
        busy
    )
    assert Stall(4.0, 0.2, 0.0, 0.3).cause == "blocked"  # neither ran nor waited: slept in a call
    assert Stall(4.0, 0.2, 0.0, None).cause == "starved or blocked"  # no schedstat: cannot tell
    assert Stall(4.0, 2.0, 0.0, 1.9).cause == "busy"  # half the stall in CPU
    assert Stall(4.0, 2.0, 0.0, 2.0).cause == "starved"  # the wait first


def test_the_calling_threads_wait_for_a_core_is_read_from_the_kernel() -> None:
    waited = runqueue_seconds()
    if os.path.exists(SCHEDSTAT):
        assert waited is not None and waited >= 0.0
    else:
        assert waited is None


def test_the_worker_logs_and_counts_a_stall_and_does_not_blame_the_broker_for_it(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """Heartbeats at 1 s, the broker counted lost after 5 s of silence: a loop that sleeps 1 s,
    then wakes 6 s later, heard nothing for 7 s but was itself away for 5 of them. It logs and
    counts the stall and sends a HEARTBEAT; charged the whole 7 s, it would have reconnected."""
    engine = SimpleNamespace(max_num_seqs=4, max_model_len=64, weight_version=0, vllm_metrics=False)
    metrics = WorkerMetrics("w")
    w = worker_module.Worker(WorkerConfig(model="m", name="w"), engine, metrics)  # type: ignore[arg-type]
    clock = SimpleNamespace(now=0.0)
    sent: list[bytes] = []
    reconnects: list[str] = []

    async def reconnect(reason: str) -> None:
        reconnects.append(reason)

    naps = iter([1.0, 6.0])

    async def sleep(_interval: float) -> None:
        nap = next(naps, None)
        if nap is None:
            raise asyncio.CancelledError  # the test's end
        clock.now += nap

    monkeypatch.setattr(worker_module.time, "monotonic", lambda: clock.now)
    monkeypatch.setattr(worker_module.asyncio, "sleep", sleep)
    monkeypatch.setattr(w, "_send_now", lambda command, body: sent.append(command))
    monkeypatch.setattr(w, "_reconnect", reconnect)
    w._last_heard = 0.0
    with caplog.at_level(logging.WARNING, logger=worker_module.__name__), pytest.raises(asyncio.CancelledError):
        asyncio.run(w._heartbeat())
    assert reconnects == [] and sent == [worker_module.p.HEARTBEAT] * 2
    assert w._last_heard == 5.0  # the stall, excused
    stalls = [r.getMessage() for r in caplog.records if "stalled" in r.getMessage()]
    assert len(stalls) == 1 and stalls[0].startswith("worker w: event loop stalled for 5.0 s ("), stalls
    samples = parse_samples(generate_latest(metrics.registry).decode())
    assert samples["zmq_rollout_worker_loop_stalls_total"] == 1.0
    assert samples["zmq_rollout_worker_loop_stalled_seconds_total"] == 5.0
