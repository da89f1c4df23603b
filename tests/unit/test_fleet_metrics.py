"""The broker's metrics of the fleet: weight-sync rounds, each worker, staleness.

Driven through the pure scheduler (events with ``now`` passed in) and read back the way
Prometheus reads them: the collector's exposition text, parsed.
"""

from __future__ import annotations

from typing import Any

import pytest
from helpers import parse_samples
from prometheus_client import CollectorRegistry, generate_latest

from zmq_rollout import codec
from zmq_rollout import protocol as p
from zmq_rollout.broker.metrics import SchedulerCollector
from zmq_rollout.broker.scheduler import Scheduler
from zmq_rollout.broker.stats import GONE_WORKER_RETENTION_S, LOSS_REASONS, ROUND_OUTCOMES
from zmq_rollout.config import BrokerConfig

T, C = b"trainer", b"client"
W1, W2 = b"w1-ab12", b"w2-cd34"
NAMES = {W1: "w1", W2: "w2"}


class Clock:
    now = 0.0

    def __call__(self) -> float:
        return self.now


def fleet(*workers: bytes, credits: int = 4, **config: Any) -> tuple[Scheduler, Clock]:
    s = Scheduler(BrokerConfig(**config))
    for w in workers:
        s.worker_ready(w, p.WorkerInfo(NAMES[w], "m", credits), 0.0)
    s.outbox.take()
    return s, Clock()


def metrics(s: Scheduler, clock: Clock) -> dict[str, float]:
    registry = CollectorRegistry()
    registry.register(SchedulerCollector(s, clock))
    return parse_samples(generate_latest(registry).decode())


def step(s: Scheduler, op: Any, now: float, round_id: int = 0, timeout_s: float = 60.0) -> int:
    """Send a step; the round id (from the CONTROL it sent)."""
    s.sync.step(T, p.SyncStep(round_id, op, timeout_s), now)
    controls = [body for _, _, cmd, body in s.outbox.take() if cmd == p.CONTROL]
    return controls[0].round_id if controls else round_id


def ack(s: Scheduler, w: bytes, rnd: int, op: str, now: float, ok: bool = True, version: int = 0) -> None:
    s.sync.ack(w, p.ControlAck(rnd, op, ok, version, "" if ok else "boom", version if op == "commit" else None), now)
    s.outbox.take()


def bucket(nbytes: int) -> p.Bucket:
    return p.Bucket(0, nbytes, [p.TensorMeta("w", "float32", [nbytes // 4], 0, nbytes)])


def round_to(s: Scheduler, version: int, start: float, workers: tuple[bytes, ...] = (W1, W2)) -> int:
    """A whole round: begin, one 1000-byte shm bucket, commit ``version``; 1 s per step."""
    rnd = step(s, p.Begin(), start)
    for w in workers:
        ack(s, w, rnd, "begin", start + 0.5)
    step(s, p.LoadShm("/zr", bucket(1000), begin=True, finish=True), start + 1, rnd)
    for w in workers:
        ack(s, w, rnd, "load_shm", start + 1.25)
    step(s, p.Commit(version), start + 2, rnd)
    for w in workers:
        ack(s, w, rnd, "commit", start + 2.5, version=version)
    return rnd


def test_a_committed_round_counts_steps_bytes_duration_and_versions() -> None:
    s, clock = fleet(W1, W2)
    before = metrics(s, clock)
    assert {f"zmq_rollout_sync_rounds_total{{outcome={o}}}" for o in ROUND_OUTCOMES} <= set(before)
    assert before["zmq_rollout_sync_rounds_in_progress"] == 0
    assert before["zmq_rollout_fleet_weight_version"] == 0

    rnd = step(s, p.Begin(), 10.0)
    assert metrics(s, clock)["zmq_rollout_sync_rounds_in_progress"] == 1
    ack(s, W1, rnd, "begin", 10.5)
    ack(s, W2, rnd, "begin", 10.5)
    step(s, p.LoadShm("/zr", bucket(1000), begin=True, finish=True), 11.0, rnd)
    ack(s, W1, rnd, "load_shm", 11.1)
    ack(s, W2, rnd, "load_shm", 11.25)
    step(s, p.Commit(7), 12.0, rnd)
    ack(s, W1, rnd, "commit", 12.5, version=7)
    ack(s, W2, rnd, "commit", 12.5, version=7)

    m = metrics(s, clock)
    assert m["zmq_rollout_sync_rounds_total{outcome=committed}"] == 1
    assert m["zmq_rollout_sync_rounds_total{outcome=failed}"] == 0
    assert m["zmq_rollout_sync_rounds_in_progress"] == 0
    assert m["zmq_rollout_sync_round_duration_seconds_count"] == 1
    assert m["zmq_rollout_sync_round_duration_seconds_sum"] == pytest.approx(2.5)
    assert m["zmq_rollout_sync_bytes_total{step=load_shm}"] == 2000  # each member loaded the bucket
    shm = "zmq_rollout_sync_step_duration_seconds"
    assert m[f"{shm}_count{{step=load_shm}}"] == 1
    assert m[f"{shm}_sum{{step=load_shm}}"] == pytest.approx(0.25)  # the barrier waits for the slower one
    assert m[f"{shm}_bucket{{le=0.1,step=load_shm}}"] == 0 and m[f"{shm}_bucket{{le=0.25,step=load_shm}}"] == 1
    assert {k for k in m if k.startswith(f"{shm}_count")} == {
        f"{shm}_count{{step={op}}}" for op in ("begin", "load_shm", "commit")
    }
    assert m["zmq_rollout_fleet_weight_version"] == 7
    assert m["zmq_rollout_worker_weight_version{worker=w1}"] == m["zmq_rollout_worker_weight_version{worker=w2}"] == 7
    assert all(
        v == 0 for k, v in m.items() if k.startswith(("zmq_rollout_sync_evictions", "zmq_rollout_sync_step_failures"))
    )
    failures = "zmq_rollout_sync_step_failures_total"  # at 0 from a step's first run: rate() sees a first failure
    assert {k for k in m if k.startswith(failures)} == {
        f"{failures}{{step={op}}}" for op in ("begin", "load_shm", "commit")
    }


@pytest.mark.parametrize("outcome", ["failed", "aborted", "trainer_lost"])
def test_rounds_that_do_not_commit_are_counted_by_outcome(outcome: str) -> None:
    s, clock = fleet(W1, W2)
    rnd = step(s, p.Begin(), 1.0)
    ack(s, W1, rnd, "begin", 1.0)
    ack(s, W2, rnd, "begin", 1.0)
    if outcome == "failed":
        step(s, p.Commit(3), 2.0, rnd)
        ack(s, W1, rnd, "commit", 2.0, version=3)
        ack(s, W2, rnd, "commit", 2.0, ok=False)
    elif outcome == "aborted":
        step(s, p.Abort(), 2.0, rnd)
        ack(s, W1, rnd, "abort", 2.0)
        ack(s, W2, rnd, "abort", 2.0)
    else:
        s.client_seen(T, 1.0)  # the shell does this for every message of a client
        s.client_gone(T, "client disconnected", 2.0)
    m = metrics(s, clock)
    assert {o: m[f"zmq_rollout_sync_rounds_total{{outcome={o}}}"] for o in ROUND_OUTCOMES} == {
        o: int(o == outcome) for o in ROUND_OUTCOMES
    }
    assert m["zmq_rollout_sync_rounds_in_progress"] == 0
    assert m["zmq_rollout_sync_round_duration_seconds_sum"] == pytest.approx(1.0)
    assert m["zmq_rollout_sync_step_failures_total{step=begin}"] == 0
    if outcome != "trainer_lost":  # the trainer left before any step but begin
        assert m[f"zmq_rollout_sync_step_failures_total{{step={'commit' if outcome == 'failed' else 'abort'}}}"] == int(
            outcome == "failed"
        )


def test_members_lost_in_a_round_are_counted_by_reason() -> None:
    s, clock = fleet(W1, W2, heartbeat_interval_s=1.0, worker_liveness=5)
    rnd = step(s, p.Begin(), 1.0, timeout_s=2.0)
    ack(s, W1, rnd, "begin", 1.5)
    s.worker_seen(W2, 2.0)
    s.tick(3.5)  # W2 missed the begin deadline (3.0): evicted
    s.outbox.take()
    step(s, p.ReceiveBucket(bucket(400)), 4.0, rnd)
    s.tick(6.6)  # W1 silent since 1.5: expired mid-step
    s.outbox.take()
    m = metrics(s, clock)
    assert m["zmq_rollout_sync_evictions_total{reason=evicted}"] == 1
    assert m["zmq_rollout_sync_evictions_total{reason=expired}"] == 1
    assert m["zmq_rollout_workers_lost_total{reason=evicted}"] == 1
    assert m["zmq_rollout_workers_lost_total{reason=expired}"] == 1
    assert "zmq_rollout_sync_bytes_total{step=receive_bucket}" not in m  # nobody loaded it
    assert set(LOSS_REASONS) == {k.split("=")[1][:-1] for k in m if k.startswith("zmq_rollout_sync_evictions")}


def test_per_worker_series_follow_credits_results_and_losses() -> None:
    s, clock = fleet(W1, W2, credits=2)
    s.submit(C, [p.JobSpec(f"j{i}", p.SamplingParams(n=1), prompt="x") for i in range(3)], 1.0)
    sent = s.outbox.take()
    tickets = {ident: [a.ticket for a in body] for _, ident, cmd, body in sent if cmd == p.JOBS}
    s.worker_final(W1, [p.Result(tickets[W1][0], [1], [p.Sample(0, [2], [-0.1], "stop")], 0, "w1")], 2.0)
    s.outbox.take()
    clock.now = 4.5
    s.worker_seen(W2, 4.0)
    m = metrics(s, clock)
    held = {w: len(s.workers[w].running) for w in (W1, W2)}
    for ident, name in NAMES.items():
        assert m[f"zmq_rollout_worker_credits{{worker={name}}}"] == 2
        assert m[f"zmq_rollout_worker_credits_used{{worker={name}}}"] == held[ident]
        assert m[f"zmq_rollout_worker_credits_free{{worker={name}}}"] == 2 - held[ident]
        assert m[f"zmq_rollout_worker_joins_total{{worker={name}}}"] == 1
    assert m["zmq_rollout_worker_completed_jobs_total{worker=w1}"] == 1
    assert m["zmq_rollout_worker_completed_jobs_total{worker=w2}"] == 0
    assert m["zmq_rollout_worker_heartbeat_age_seconds{worker=w1}"] == pytest.approx(2.5)
    assert m["zmq_rollout_worker_heartbeat_age_seconds{worker=w2}"] == pytest.approx(0.5)

    s.worker_gone(W2, "worker left", 5.0)  # its jobs go back to the queue
    m = metrics(s, clock)
    assert not any("worker=w2" in k and "_total" not in k for k in m)  # its gauges end with it
    assert m["zmq_rollout_worker_requeued_jobs_total{worker=w2}"] == held[W2]
    assert m["zmq_rollout_workers_lost_total{reason=disconnected}"] == 1

    s.worker_ready(b"w2-ef56", p.WorkerInfo("w2", "m", 2), 6.0)  # back under a new identity
    assert metrics(s, clock)["zmq_rollout_worker_joins_total{worker=w2}"] == 2
    s.worker_gone(b"w2-ef56", "heartbeat expired", 7.0)
    s.tick(7.0 + GONE_WORKER_RETENTION_S - 1)
    assert "zmq_rollout_worker_joins_total{worker=w2}" in metrics(s, clock)
    s.tick(7.0 + GONE_WORKER_RETENTION_S + 1)
    m = metrics(s, clock)
    assert not any("worker=w2" in k for k in m)  # its counters too, after the retention
    assert "zmq_rollout_worker_joins_total{worker=w1}" in m


def test_two_connections_under_one_name_are_one_series() -> None:
    s, clock = fleet(W1, credits=2)
    s.worker_ready(b"w1-again", p.WorkerInfo("w1", "m", 3), 0.5)  # a reconnect before the old one is purged
    m = metrics(s, clock)
    assert m["zmq_rollout_worker_credits{worker=w1}"] == 5
    assert m["zmq_rollout_worker_joins_total{worker=w1}"] == 2
    s.worker_gone(W1, "heartbeat expired", 1.0)
    assert metrics(s, clock)["zmq_rollout_worker_credits{worker=w1}"] == 3
    assert s.stats.workers["w1"].gone_since is None  # one connection is still there


def relayed(result: p.Result, command: bytes = p.FINAL) -> Any:
    """``result`` as the broker gets it off the wire: samples left raw (FINAL), or sealed
    whole (SEALED_FINAL)."""
    body = [result] if command == p.FINAL else [p.seal(result)]
    return codec.Decoder(codec.FROM_WORKER).decode(codec.encode(command, body)).body


@pytest.mark.parametrize("command", [p.FINAL, p.SEALED_FINAL], ids=["final", "sealed_final"])
def test_staleness_per_sample_and_spans_of_samples_that_crossed_a_sync(command: bytes) -> None:
    s, clock = fleet(W1, credits=8)
    s.submit(C, [p.JobSpec("old", p.SamplingParams(n=3), prompt="x")], 1.0)
    s.submit(C, [p.JobSpec("crossed", p.SamplingParams(n=2), prompt="x")], 1.0)
    tickets = {a.job.job_id: a.ticket for _, _, cmd, body in s.outbox.take() if cmd == p.JOBS for a in body}
    round_to(s, 1, 2.0, (W1,))
    round_to(s, 2, 5.0, (W1,))  # fleet at 2; both jobs were dispatched at version 0
    sample = p.Sample(0, [5], [-0.1], "length")
    s.worker_final(W1, relayed(p.Result(tickets["old"], [1], [sample] * 3, 0, "w1"), command), 9.0)
    crossed = [
        p.Sample(0, [5, 6, 7, 8], [-0.1] * 4, "length", None, [0, 0, 1, 2]),
        p.Sample(1, [5, 6], [-0.1] * 2, "length", [{5: -0.1}, {6: -0.1}], [1, 2]),
    ]
    s.worker_final(W1, relayed(p.Result(tickets["crossed"], [1], crossed, 2, "w1"), command), 9.0)
    m = metrics(s, clock)
    stale = "zmq_rollout_sample_staleness_versions"
    assert m[f"{stale}_count"] == 5
    assert m[f"{stale}_sum"] == 3 * 2 + 2 + 1  # three samples of version 0; oldest tokens 0 and 1
    assert m[f"{stale}_bucket{{le=0.0}}"] == 0 and m[f"{stale}_bucket{{le=1.0}}"] == 1
    span = "zmq_rollout_sample_span_versions"
    assert m[f"{span}_count"] == 2
    assert m[f"{span}_sum"] == 2 + 1
    assert m[f"{span}_bucket{{le=1.0}}"] == 1 and m[f"{span}_bucket{{le=2.0}}"] == 2


def test_samples_of_the_fleet_version_are_not_stale() -> None:
    s, clock = fleet(W1)
    round_to(s, 4, 1.0, (W1,))
    s.submit(C, [p.JobSpec("j", p.SamplingParams(n=2), prompt="x")], 5.0)
    (assignment,) = next(body for _, _, cmd, body in s.outbox.take() if cmd == p.JOBS)
    s.worker_final(W1, relayed(p.Result(assignment.ticket, [1], [p.Sample(0, [5], [-0.1], "stop")] * 2, 4, "w1")), 6.0)
    m = metrics(s, clock)
    stale = "zmq_rollout_sample_staleness_versions"
    assert m[f"{stale}_bucket{{le=0.0}}"] == m[f"{stale}_count"] == 2
    assert m["zmq_rollout_sample_span_versions_count"] == 0


def test_a_worker_that_says_disconnect_is_lost_as_disconnected(
    start_broker: Any, start_double: Any, wait_until: Any
) -> None:
    """The loss reasons the socket shell gives (its strings) map to their labels."""
    broker = start_broker()
    double = start_double(broker)
    double.stop()
    wait_until(
        lambda: broker.metrics().get("zmq_rollout_workers_lost_total{reason=disconnected}") == 1,
        what="the worker's DISCONNECT to be counted",
    )
    assert broker.metrics()["zmq_rollout_workers_lost_total{reason=other}"] == 0


def test_the_brokers_view_of_a_sample_has_the_samples_layout() -> None:
    from zmq_rollout.broker.staleness import SampleVersions

    assert SampleVersions.__struct_fields__ == p.Sample.__struct_fields__
